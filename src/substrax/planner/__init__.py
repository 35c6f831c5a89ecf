"""Plan a sharded training step before anything is compiled: memory, traffic, time, layout.

``plan("llama3-70b", 512, Hardware(memory_bytes=80e9), Workload(batch_tokens=4_000_000,
seq=8192))`` ranks every layout; ``python -m substrax.plan`` prints the table.
"""

from substrax.planner._architectures import ARCHITECTURES as ARCHITECTURES
from substrax.planner._architectures import Leaf as Leaf
from substrax.planner._architectures import TransformerConfig as TransformerConfig
from substrax.planner._architectures import architecture as architecture
from substrax.planner._architectures import config_from_leaves as config_from_leaves
from substrax.planner._architectures import transformer_leaves as transformer_leaves
from substrax.planner._plan import Candidate as Candidate
from substrax.planner._plan import Hardware as Hardware
from substrax.planner._plan import Layout as Layout
from substrax.planner._plan import Workload as Workload
from substrax.planner._plan import evaluate as evaluate
from substrax.planner._plan import layouts as layouts
from substrax.planner._rank import Plan as Plan
from substrax.planner._rank import parse_bytes as parse_bytes
from substrax.planner._rank import parse_count as parse_count
from substrax.planner._rank import plan as plan

__all__ = [
    "ARCHITECTURES",
    "Candidate",
    "Hardware",
    "Layout",
    "Leaf",
    "Plan",
    "TransformerConfig",
    "Workload",
    "architecture",
    "config_from_leaves",
    "evaluate",
    "layouts",
    "parse_bytes",
    "parse_count",
    "plan",
    "transformer_leaves",
]
