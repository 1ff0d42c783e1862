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
TILELANG_DTYPES = {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
                   "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"}


class Collected(reporter.Reporter):
    def __init__(self):
        self.problems: list[str] = []

    def flake(self, message):
        if isinstance(message, messages.UndefinedName) and message.message_args[0] in TILELANG_DTYPES:
            return
        self.problems.append(str(message))

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
        path = REPO / name
        pyflakes_api.check(path.read_text(), str(path.relative_to(REPO)), collected)
    assert not collected.problems, "\n".join(collected.problems)
