"""`python -m hlo_inspect FILE.txt [--json] [--html OUT.html]`: the same command as `hlo-inspect`."""

from hlo_inspect.cli import run

if __name__ == "__main__":
    run()
