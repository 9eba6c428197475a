"""Small formatting and parsing helpers shared by hlo_inspect's reports and the jaxfuse CLI.

    format_bytes(1536)                                     # '1.5 KiB'
    parse_xla_flags("--xla_gpu_enable_triton_gemm=false")  # {'xla_gpu_enable_triton_gemm': False}
"""

from __future__ import annotations

from typing import Any

__all__ = ["format_bytes", "parse_xla_flags"]


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def parse_xla_flags(flags: str) -> dict[str, Any]:
    """`"--xla_gpu_enable_triton_gemm=false --xla_disable_hlo_passes=a,b"` -> compiler options for `inspect`.

    Booleans and integers are converted; a flag without `=` means true. ValueError names a malformed flag.
    """
    options: dict[str, Any] = {}
    for item in flags.split():
        name, eq, value = item.lstrip("-").partition("=")
        if not name.startswith("xla_"):
            raise ValueError(f"xla_flags: {item!r} is not an XLA flag (expected --xla_name=value)")
        if not eq or value.lower() == "true":
            options[name] = True
        elif value.lower() == "false":
            options[name] = False
        elif value.lstrip("-").isdigit():
            options[name] = int(value)
        else:
            options[name] = value
    return options
