"""Block-size calibration on a busy machine, with scripted timings: spikes change no choice, a poisoned cached table
is caught at load or corrected within a bounded number of steps, a quiet one is kept."""

from __future__ import annotations

import json
import random
import time
from types import SimpleNamespace

import pytest
import torch
from in_process import invoke

from dflash_local.block_policy import (
    HISTORY_DECAY,
    AcceptanceEstimate,
    BlockPolicy,
    CostTable,
    calibration,
    expected_tokens,
    load_policy,
    measure_costs,
)

BLOCK = 16
RATE = 0.8


def quiet_target(k: int) -> float:
    """The scripted machine's target forward of k tokens when quiet: CPU-like, 10 ms plus 0.3 ms a token."""
    return 0.010 + 0.0003 * (k - 1)


QUIET_DRAFT = 0.0025


class Machine:
    """A scripted clock (StepClock's stand-in): each model call advances it by its quiet cost, times `load` for the
    calls whose index is in `busy`."""

    def __init__(self, busy: range = range(0)) -> None:
        self.now, self.calls, self.busy = 0.0, 0, busy

    def run(self, seconds: float) -> None:
        self.now += seconds * (10.0 if self.calls in self.busy else 1.0)
        self.calls += 1

    def mark(self) -> float:
        return self.now

    def seconds(self, begin: float, end: float) -> float:
        return end - begin


class ScriptedTarget:
    vocab_size, device, length, verify_rows = 64, torch.device("cpu"), 0, None

    def __init__(self, machine: Machine) -> None:
        self.machine = machine

    def set_feature_layers(self, layers: list[int]) -> None:
        pass

    def trim(self, length: int) -> None:
        self.length = length

    def forward(self, ids: torch.Tensor, all_logits: bool = True, features: bool = True, greedy: bool = False):
        self.machine.run(quiet_target(len(ids)))
        self.length += len(ids)
        return SimpleNamespace(features=torch.zeros(len(ids), 4), logits=None)


class ScriptedDrafter:
    block_size, target_layer_ids, length, source = BLOCK, [0], 0, "dflash"

    def __init__(self, machine: Machine) -> None:
        self.machine = machine

    def trim(self, length: int) -> None:
        self.length = min(self.length, length)

    def propose(self, target, new_features, tokens, start, size, rows=None) -> None:
        self.machine.run(QUIET_DRAFT)


def calibrate(monkeypatch, busy: range = range(0)) -> CostTable:
    machine = Machine(busy)
    monkeypatch.setattr(calibration, "StepClock", lambda device: machine)
    return measure_costs(ScriptedTarget(machine), ScriptedDrafter(machine))


def known_drafter(block: int = BLOCK) -> AcceptanceEstimate:
    """A drafter history of 1000 steps accepting each position at RATE."""
    return AcceptanceEstimate([1000.0] * (block - 1), [1000.0 * RATE] * (block - 1), HISTORY_DECAY)


def choices(costs: CostTable) -> list[int]:
    """The first choice at several acceptance rates and tokens left."""
    picked = []
    for rate in (0.05, 0.2, 0.4, 0.6, 0.8, 0.95):
        for limit in (3, 6, 16):
            history = AcceptanceEstimate([1000.0] * (BLOCK - 1), [1000.0 * rate] * (BLOCK - 1), HISTORY_DECAY)
            picked.append(BlockPolicy(BLOCK, costs, history).choose(limit))
    return picked


def test_a_burst_of_load_during_calibration_changes_no_choice(monkeypatch):
    """Six model calls in a row run 10x slower (a build starting, a tab loading), wherever they fall in the
    calibration: the table, and every choice made from it, are those of a quiet calibration."""
    clean = calibrate(monkeypatch)
    assert clean.target_s[1] == pytest.approx(quiet_target(1)) and clean.target_s[16] == pytest.approx(quiet_target(16))
    expected = choices(clean)
    assert len(set(expected)) >= 3, expected
    for first in range(0, 90, 3):
        spiked = calibrate(monkeypatch, range(first, first + 6))
        assert spiked.target_s == pytest.approx(clean.target_s), first
        assert choices(spiked) == expected, first


def quiet_table() -> CostTable:
    return CostTable({k: quiet_target(k) for k in range(1, BLOCK + 1)}, dict.fromkeys(range(2, BLOCK + 1), QUIET_DRAFT))


def save_table(path, costs: CostTable) -> None:
    BlockPolicy(BLOCK, costs, known_drafter(), path).save()


def poisoned(shape: str) -> CostTable:
    """The shapes found in tables calibrated on a contended machine."""
    costs = quiet_table()
    plain = costs.target_s[1]
    if shape == "verify-2 13x":
        costs.target_s |= {k: plain * (11 + k) for k in range(2, BLOCK + 1)}
    elif shape == "verify-8 31x":
        costs.target_s |= {k: plain * 4 * k if k < 8 else plain * 31 for k in range(2, BLOCK + 1)}
    else:  # falls from k = 1 to k = 4, rises again
        costs.target_s |= {2: plain * 0.6, 3: plain * 0.4, 4: plain * 0.3, 8: plain * 0.9}
    return costs


@pytest.mark.parametrize("shape", ["verify-2 13x", "verify-8 31x", "falls to k = 4"])
def test_a_poisoned_cached_table_is_calibrated_afresh_at_load(tmp_path, shape):
    """The cached table holds what no machine measures: it is measured afresh at load, the drafter's history kept."""
    path = tmp_path / "pair.json"
    save_table(path, poisoned(shape))
    calls = []

    def calibrate_now() -> CostTable:
        calls.append(1)
        return quiet_table()

    policy = load_policy(path, BLOCK, calibrate_now)
    assert calls == [1]
    assert policy.costs.target_s == quiet_table().target_s
    assert policy.history.accepted == known_drafter().accepted
    assert json.loads(path.read_text())["costs"]["target_s"]["2"] == quiet_target(2)


def timed(factor: float = 1.0, noise: float = 1.0, draft_factor: float = 1.0):
    """A load's check on the scripted machine, `factor` times as slow (the drafter draft_factor): three rounds of
    each size it is asked for, one of them `noise` times slower."""

    def check(sizes: list[int]) -> tuple[dict, dict]:
        target = {k: [factor * quiet_target(k) * n for n in (1.0, noise, 1.0)] for k in sizes}
        return target, {k: [draft_factor * QUIET_DRAFT * n for n in (noise, 1.0, 1.0)] for k in sizes if k > 1}

    return check


def test_a_cached_table_is_checked_against_a_few_timings_at_load(tmp_path):
    """Consistent in itself but not with this machine now: another verify-k / decode-1 ratio (k: the size the table's
    choice rests on, or the block) is calibrated afresh, a machine twice as slow throughout rescales the table (shape
    kept), one within the noise keeps it as it is."""
    path = tmp_path / "pair.json"
    calls = []

    def calibrate_now() -> CostTable:
        calls.append(1)
        return quiet_table()

    steep = quiet_table()
    steep.target_s = {k: quiet_target(1) * (1 + 0.5 * (k - 1)) for k in range(1, BLOCK + 1)}  # CPU-linear
    save_table(path, steep)
    policy = load_policy(path, BLOCK, calibrate_now, timed())
    assert calls == [1] and policy.costs.target_s == quiet_table().target_s
    assert policy.costs.check == "calibrated afresh at load: verify-3 / decode-1 was 2.00, timed 1.06"

    save_table(path, quiet_table())
    slow = load_policy(path, BLOCK, calibrate_now, timed(2.0, draft_factor=2.0))
    assert calls == [1] and slow.costs.check == "rescaled: target x2.00, drafter x2.00"
    assert slow.costs.target_s == pytest.approx({k: 2 * quiet_target(k) for k in range(1, BLOCK + 1)})
    assert slow.costs.draft_s[2] == pytest.approx(2 * QUIET_DRAFT)

    save_table(path, quiet_table())
    kept = load_policy(path, BLOCK, calibrate_now, timed(1.1, noise=3.0, draft_factor=1.3))
    assert calls == [1] and kept.costs.check == "kept"
    assert kept.costs.target_s == quiet_table().target_s and kept.costs.draft_s == quiet_table().draft_s


def dear_target(k: int) -> float:
    """A machine where verifying is dear (a big model on a CPU): 10 ms plus 6 ms a token, the drafter 15 ms."""
    return 0.010 + 0.006 * (k - 1)


DEAR_DRAFT = 0.015


def simulate(policy: BlockPolicy, steps: int, busy: float = 0.2, dear: bool = False, seed: int = 0) -> list[int]:
    """Run `steps` steps on the scripted machine (quiet, or dear), each draft accepted at RATE and a share `busy` of
    the steps stalled 10x (a machine shared with builds and tests); the sizes chosen."""
    chance, chosen = random.Random(seed), []
    target, draft = (dear_target, DEAR_DRAFT) if dear else (quiet_target, QUIET_DRAFT)
    for _ in range(steps):
        k = policy.choose(10_000)
        accepted = next((i for i in range(k - 1) if chance.random() >= RATE), k - 1)
        stall = 10.0 if chance.random() < busy else 1.0
        policy.observe(k, accepted, stall * draft if k > 1 else 0.0, stall * target(k))
        chosen.append(k)
    return chosen


def speed(k: int, dear: bool = False) -> float:
    """Expected tokens per second of k on the quiet (or dear) machine at RATE, stalls aside."""
    target, draft = (dear_target, DEAR_DRAFT) if dear else (quiet_target, QUIET_DRAFT)
    return expected_tokens([RATE] * (BLOCK - 1), BLOCK)[k] / (target(k) + (draft if k > 1 else 0.0))


def share_of_best(chosen: list[int], dear: bool = False) -> float:
    """The mean speed of the sizes chosen over the best speed there is."""
    best = max(speed(k, dear) for k in range(1, BLOCK + 1))
    return sum(speed(k, dear) for k in chosen) / len(chosen) / best


def test_a_wrong_table_that_looks_consistent_is_corrected_within_bounded_steps(tmp_path):
    """A cached table with a CPU-linear shape (verify-k = k plain steps: plain steps win by it) on a machine where
    verifying is nearly free and one step in five stalls 10x, loaded unchecked: its sizes are stale, probes and
    explorations try them within their budget, and from step 300 on auto chooses sizes within 0.95x of the best
    speed there is. Where verifying is dear, the same table stays on plain steps."""
    path = tmp_path / "pair.json"
    steep = quiet_table()
    steep.target_s = {k: quiet_target(1) * k for k in range(1, BLOCK + 1)}
    save_table(path, steep)
    policy = load_policy(path, BLOCK, quiet_table)
    assert policy.costs.target_s == steep.target_s  # consistent in itself: kept
    chosen = simulate(policy, 500)
    assert share_of_best(chosen[300:]) >= 0.95, chosen[300:]
    assert chosen.index(next(k for k in chosen if k > 1)) < 200  # the first probe comes within the probe budget
    save_table(path, steep)
    assert share_of_best(simulate(load_policy(path, BLOCK, quiet_table), 500, dear=True)[300:], dear=True) >= 0.95


def test_plain_steps_drifting_from_the_table_make_its_sizes_stale_and_explored():
    """A table just calibrated beside a CPU-heavy process (plain steps 20 ms, verify-k k of them: plain steps win by
    it), then the process ends: plain steps take 10 ms and verifying is nearly free (one step in five still stalls).
    The plain steps' drift makes every drafting size stale, and from step 300 on auto chooses sizes within 0.95x of
    the best speed there is; where verifying is dear, it stays on plain steps."""
    for dear in (False, True):
        costs = CostTable({k: 0.020 * k for k in range(1, BLOCK + 1)}, dict.fromkeys(range(2, BLOCK + 1), 0.03))
        chosen = simulate(BlockPolicy(BLOCK, costs, known_drafter()), 500, dear=dear)
        assert chosen[:8] == [1] * 8
        assert share_of_best(chosen[300:], dear) >= 0.95, (dear, chosen[300:])


def test_a_quiet_table_is_kept_through_generations(tmp_path):
    """A table calibrated on a quiet machine is kept as it is by the check at load (whose timings hold a stall);
    then, through generations on that machine with one step in five stalled 10x, auto keeps to the best speed there
    is from the first step, and the stalls do not make verify-16 look dearer than 1.5x what it is."""
    path = tmp_path / "pair.json"
    save_table(path, quiet_table())
    policy = load_policy(path, BLOCK, quiet_table, timed(noise=2.0))
    assert policy.costs.check == "kept" and policy.costs.target_s == quiet_table().target_s
    assert share_of_best(simulate(policy, 300)) >= 0.95
    verify = policy.costs.target_s[BLOCK] / policy.costs.target_s[1]
    assert verify < 1.5 * quiet_target(BLOCK) / quiet_target(1)


def test_doctor_says_when_a_cached_table_looks_inconsistent(tmp_path, monkeypatch):
    """One line for the consistent tables; one per inconsistent table, naming its file, when it was measured and
    what is wrong; nothing where no table is cached."""
    from dflash_local.doctor import cost_table_checks

    monkeypatch.setenv("DFLASH_HOME", str(tmp_path))
    assert cost_table_checks() == []
    folder = tmp_path / "block-costs"
    save_table(folder / "quiet.json", quiet_table())
    (ok,) = cost_table_checks()
    assert ok.ok and ok.found == f"1 in {folder}, consistent"
    save_table(folder / "busy.json", poisoned("verify-2 13x"))
    (bad,) = cost_table_checks()
    assert bad.ok is False and bad.found.startswith("busy.json (measured: no date) looks inconsistent: ")
    assert "the target's forward of k = 2 costs 13.00x its cost at k = 1" in bad.found


def test_bench_calibrate_shows_the_timings_the_fit_and_when(tmp_path):
    """`dflash bench --calibrate` on the bundled pair: the date measured, and per k the calibration's timings where
    it timed k ('-' where interpolated) beside the fitted costs; with --json the same rows in the report."""
    env = {"DFLASH_HOME": str(tmp_path), "COLUMNS": "250"}
    args = ["bench", "tiny", "--calibrate", "--limit", "1", "--max-new-tokens", "8", "--no-lookup"]
    shown = invoke(*args, env=env)
    assert shown.exit_code == 0, shown.stderr
    assert f"measured {time.strftime('%Y-%m-%d')}" in shown.stdout and "target timings ms" in shown.stdout
    rows = {line.split()[1]: line for line in shown.stdout.splitlines() if line.startswith("│")}
    assert " / " in rows["16"] and " / " not in rows["5"], shown.stdout
    report = json.loads(invoke(*args, "--json", env=env).stdout)
    sizes = {row["k"]: row for row in report["calibration"]["sizes"]}
    assert len(sizes[16]["target_samples_ms"]) >= 5 and sizes[5]["target_samples_ms"] == []
    assert sizes[16]["target_ms"] <= sizes[16]["target_samples_ms"][0] + 1e-9


def test_the_benchmarks_timer_is_the_median_of_the_timed_calls(monkeypatch):
    """calibration.median_ms, the timer benchmarks/ imports: warm-up calls are not timed, the rest give their median
    in milliseconds on the device's clock."""
    machine = Machine()
    monkeypatch.setattr(calibration, "StepClock", lambda device: machine)
    costs = iter([9.0, 9.0, 9.0, 0.003, 0.001, 0.008])  # three warm-up calls, then three timed ones
    assert calibration.median_ms(lambda: machine.run(next(costs)), "cpu", repeats=3) == pytest.approx(3.0)
