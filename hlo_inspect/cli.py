"""`hlo-inspect FILE.txt [--json]`: the kernel-by-kernel report of a saved optimized HLO text file.

    python -c "import jax; print(jax.jit(f).lower(x).compile().as_text())" > f.hlo.txt
    hlo-inspect f.hlo.txt
    hlo-inspect f.hlo.txt --json > f.report.json

Pure Python: no JAX needed. Malformed text exits with status 2 and the line that could not be read.
"""

from __future__ import annotations

import sys

from absl import flags

from hlo_inspect.parser import HloParseError
from hlo_inspect.report import from_text

USAGE = "usage: hlo-inspect FILE.txt [--json] [--html OUT.html]  (FILE '-' reads standard input)"


def _flags() -> flags.FlagValues:
    fv = flags.FlagValues()
    flags.DEFINE_bool("json", False, "Print the report as JSON (schema hlo_inspect.report/1).", flag_values=fv)
    flags.DEFINE_string("html", None, "Also write a self-contained HTML report to this path.", flag_values=fv)
    return fv


def main(argv: list[str]) -> int:
    """Parse `argv` (without the program name), print the report; returns the exit status."""
    fv = _flags()
    if any(a in ("-h", "--help", "-help", "--helpfull") for a in argv):
        print(__doc__.strip() + "\n\nflags:\n" + fv.get_help())
        return 0
    try:
        rest = fv(["hlo-inspect"] + list(argv))[1:]
    except flags.Error as e:
        print(f"hlo-inspect: {e}\n{USAGE}", file=sys.stderr)
        return 2
    if len(rest) != 1:
        print(f"hlo-inspect: expected one HLO text file, got {len(rest)}\n{USAGE}", file=sys.stderr)
        return 2
    path = rest[0]
    try:
        text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
    except OSError as e:
        print(f"hlo-inspect: cannot read {path}: {e.strerror}", file=sys.stderr)
        return 2
    try:
        report = from_text(text, title=path)
    except HloParseError as e:
        print(f"hlo-inspect: {path}: {e}", file=sys.stderr)
        return 2
    if fv.html:
        report.to_html(fv.html)
    print(report.to_json() if fv.json else report.table())
    return 0


def run() -> None:
    """Console-script entry point."""
    import signal

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `... | head` ends quietly
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    run()
