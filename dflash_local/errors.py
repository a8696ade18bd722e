"""The one exception type whose message is shown to users as-is."""


class DFlashError(Exception):
    """A problem the user can fix; its message is one clear sentence."""
