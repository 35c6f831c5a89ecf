"""Plan a sharded training step before anything is compiled: memory, traffic, time, layout.

``plan("llama3-70b", 512, Hardware(memory_bytes=80e9), Workload(batch_tokens=4_000_000,
seq=8192))`` ranks every layout; ``python -m substrax.planner`` prints the table. Candidates
are :class:`substrax.layout.Layout` objects: ``candidate.layout.make_mesh()`` and the layout
are what the Flax adapter applies.
"""

from substrax.planner._architectures import ARCHITECTURES as ARCHITECTURES
from substrax.planner._architectures import Leaf as Leaf
from substrax.planner._architectures import TransformerConfig as TransformerConfig
from substrax.planner._architectures import architecture as architecture
from substrax.planner._architectures import config_from_leaves as config_from_leaves
from substrax.planner._architectures import inferred_width as inferred_width
from substrax.planner._architectures import transformer_leaves as transformer_leaves
from substrax.planner._cli import main as main
from substrax.planner._estimate import Candidate as Candidate
from substrax.planner._estimate import Hardware as Hardware
from substrax.planner._estimate import LeafPlan as LeafPlan
from substrax.planner._estimate import Workload as Workload
from substrax.planner._estimate import evaluate as evaluate
from substrax.planner._hardware import HARDWARE as HARDWARE
from substrax.planner._hardware import profile_of as profile_of
from substrax.planner._layouts import layouts as layouts
from substrax.planner._rank import CLOSE_TIMES as CLOSE_TIMES
from substrax.planner._rank import HEADROOM as HEADROOM
from substrax.planner._rank import MICROBATCH_CHOICES as MICROBATCH_CHOICES
from substrax.planner._rank import Plan as Plan
from substrax.planner._rank import plan as plan

__all__ = [
    "ARCHITECTURES",
    "CLOSE_TIMES",
    "HARDWARE",
    "HEADROOM",
    "MICROBATCH_CHOICES",
    "Candidate",
    "Hardware",
    "Leaf",
    "LeafPlan",
    "Plan",
    "TransformerConfig",
    "Workload",
    "architecture",
    "config_from_leaves",
    "evaluate",
    "inferred_width",
    "layouts",
    "main",
    "plan",
    "profile_of",
    "transformer_leaves",
]
