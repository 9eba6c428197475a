"""hlo_inspect: read optimized HLO text kernel by kernel.

    import hlo_inspect
    rep = hlo_inspect.inspect(f, x, w)         # jit + lower + compile + parse (needs JAX)
    rep = hlo_inspect.from_text(open("dump.txt").read())   # a saved dump (pure Python)
    print(rep.table()); rep.to_json()
"""
from hlo_inspect.parser import Computation, HloParseError, Instruction, Module, Shape, parse
from hlo_inspect.kernels import CATEGORIES, Kernel, kernels
from hlo_inspect.report import Report, Totals, from_text, inspect
from hlo_inspect.diff import Diff, diff

__all__ = ["parse", "kernels", "inspect", "diff", "Diff", "from_text", "Report", "Totals", "Kernel", "CATEGORIES", "Module",
           "Computation", "Instruction", "Shape", "HloParseError"]
