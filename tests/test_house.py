"""The repository is a product, not a lab notebook: tracked text names no work sessions, device calls
or this project's issue numbers (docs and comments say what the code does and why, in the present
tense; history belongs to git), the README stays short and points only inside the repository, and
raw benchmark results stay out of git (benchmarks write under ``runs/``)."""

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250

# A session, call or issue word with a number, any case: singular with a number ("<word> N",
# "<word> #N"), plural with "#N" or a list or range of numbers ("<words> N-M", "<words> N and M"),
# so that a verb ("issues N-byte loads") does not count. The bracketed letters keep this file's
# own source from matching.
_WORD = r"(?:sess[i]on|ca[l]l|iss[u]e)"
WORK_LOG = re.compile(
    rf"\b{_WORD}[ \t]*#?[0-9]+|\b{_WORD}s[ \t]*(?:#[0-9]+|[0-9]+(?:[ \t]*(?:-|,|and|to|&)[ \t]*#?[0-9]+)+)",
    re.IGNORECASE)
# "#N", "#N's bars": this project's issues. "owner/repo#N" names an upstream project's and may stay.
OWN_ISSUE = re.compile(r"(?<![\w/.#-])#[0-9]+\b")
# "(sN)": a session written short.
SHORT_SESSION = re.compile(r"\([s][0-9]+\)", re.IGNORECASE)
UPSTREAM_REF = re.compile(r"[\w.-]+/[\w.-]+#[0-9]+")
# markdown link targets: [text](target) and [text]: target
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?[^)]*\)|^\s*\[[^\]]+\]:\s*(\S+)", re.MULTILINE)


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"git unavailable: {e}")
    if done.returncode != 0:
        pytest.skip(f"not a git checkout ({done.stderr.strip()})")
    return done.stdout


def _tracked_files() -> list[Path]:
    _git("rev-parse", "--show-toplevel")
    return [REPO / name for name in _git("ls-files", "-z").split("\0") if name]


def _text(path: Path) -> str | None:
    try:
        data = path.read_bytes()
    except OSError:  # tracked but deleted in the working tree, or not a plain file
        return None
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def work_log_words(line: str) -> list[str]:
    """The session / call / issue references in one line of text."""
    found, rest = [], line
    for pattern in (WORK_LOG, SHORT_SESSION, UPSTREAM_REF):  # each blanked out once seen
        for m in pattern.finditer(rest):
            if pattern is not UPSTREAM_REF:
                found.append(m.group(0))
            rest = rest[:m.start()] + " " * (m.end() - m.start()) + rest[m.end():]
    return found + [m.group(0) for m in OWN_ISSUE.finditer(rest)]


def test_work_log_words_are_recognized():
    session, call, issue = "sess" "ion", "ca" "ll", "iss" "ue"  # apart, so this source does not match
    for line in (f"measured in {session} 12", f"{session.title()}s 6-8 tried", f"({call} 8)", f"{call}s 4-7",
                 f"see {issue} #" "9", f"{session}s 22 to 30", "#" "9's bars", "as before (" "s31)",
                 f"{issue.title()} 4", f"{issue}s 4 and 7"):
        assert work_log_words(line), line
    for line in ("pytorch/pytorch#" "196082", f"each in a {session} of its own", f'scope="{session}"',
                 f"a {call} to the kernel", "# 1 comment", "x = y  # 2 bytes", f"{issue}s 16-byte loads",
                 f"{session}s of their own", f"the {call}'s output", f"it {call}s 2 kernels"):
        assert not work_log_words(line), line


def test_no_session_call_or_issue_numbers_in_tracked_files():
    hits = []
    for path in _tracked_files():
        text = _text(path)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            words = work_log_words(line)
            if words:
                hits.append(f"{path.relative_to(REPO)}:{number}: {', '.join(words)}: {line.strip()[:120]}")
    files = sorted({hit.split(":", 1)[0] for hit in hits})
    assert not hits, (
        f"{len(hits)} line(s) in {len(files)} tracked file(s) name a work session, device call or this "
        f"project's issue number; say what the code does and why instead (files: {', '.join(files)}):\n"
        + "\n".join(hits))


def test_readme_is_short_and_links_only_inside_the_repository():
    readme = REPO / "README.md"
    text = readme.read_text(encoding="utf-8")
    lines = text.count("\n") + (0 if text.endswith("\n") else 1)
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines, at most {README_MAX_LINES}"
    outside, missing = [], []
    for m in LINK.finditer(text):
        target = (m.group(1) or m.group(2)).split("#", 1)[0]
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # a URL, or a heading
            continue
        path = (REPO / target).resolve()
        if target.startswith("/") or not path.is_relative_to(REPO):
            outside.append(target)
        elif not path.exists():
            missing.append(target)
    outside += re.findall(r"(?<![\w.])\.\./[\w./-]*", text)  # paths mentioned outside links too
    assert not outside, f"README.md points outside the repository: {sorted(set(outside))}"
    assert not missing, f"README.md links paths that do not exist: {sorted(set(missing))}"


def test_no_raw_benchmark_results_in_git():
    tracked = _git("ls-files", "bench/results").split()
    assert not tracked, (f"{len(tracked)} raw result file(s) tracked under bench/results (benchmarks write "
                         f"under runs/; curated figures go to docs/performance.md): {tracked[:10]}")
