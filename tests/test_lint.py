"""Every tracked Python file passes pyflakes: no undefined names, unused imports or variables, or
redefinitions. GPU-only tests never run on CPU machines, so a name error there would otherwise wait
for a GPU to be found. TileLang's string dtypes in kernel signatures (``T.Tensor[..., "int32"]``)
read to pyflakes as forward references and are not names."""

import subprocess
from pathlib import Path

import pytest

pyflakes_api = pytest.importorskip("pyflakes.api")
from pyflakes import messages, reporter  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


class Collected(reporter.Reporter):
    def __init__(self):
        self.problems: list[str] = []
        self.lines: list[str] = []

    def flake(self, message):
        if isinstance(message, messages.UndefinedName) and self._dtype_string(message):
            return
        self.problems.append(str(message))

    def _dtype_string(self, message) -> bool:
        """The name is a TileLang dtype written as a string literal (``"int32"``), not a bare name."""
        text = self.lines[message.lineno - 1][message.col:]
        return any(text.startswith(f"{quote}{message.message_args[0]}{quote}") for quote in "\"'")

    def syntaxError(self, filename, msg, lineno, offset, text):
        self.problems.append(f"{filename}:{lineno}: {msg}")

    def unexpectedError(self, filename, msg):
        self.problems.append(f"{filename}: {msg}")


def test_tracked_python_passes_pyflakes():
    try:
        listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "*.py"], capture_output=True, text=True,
                                timeout=60, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"git unavailable: {e}")
    collected = Collected()
    for name in listed:
        source = (REPO / name).read_text()
        collected.lines = source.splitlines()
        pyflakes_api.check(source, name, collected)
    assert not collected.problems, "\n".join(collected.problems)
