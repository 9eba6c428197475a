"""hlo_inspect: read optimized HLO text kernel by kernel."""
from hlo_inspect.parser import HloParseError, Instruction, Computation, Module, Shape, parse
