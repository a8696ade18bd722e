"""`dflash serve`: OpenAI's and Ollama's HTTP APIs over one loaded model (starlette + uvicorn).

The engine decodes one sequence at a time, so requests wait in a bounded queue, in arrival order, for the one worker
thread (engine) that renders prompts and iterates the generation; the event loop only parses (protocol, openai_api,
ollama_api), queues and streams (request). What a client may hold is bounded (hardening), and every refusal, down to
malformed HTTP, has the API's error shape.
"""

from .app import create_app
from .engine import Engine
from .hardening import Limits, exposure_warning, listen, run_server

__all__ = ["Engine", "Limits", "create_app", "exposure_warning", "listen", "run_server"]
