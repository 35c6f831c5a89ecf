"""The Flax NNX adapter of substrax: models and optax state created already sharded.

Every variable's logical axis names (``nnx.with_partitioning``) resolve through substrax rules
(or a named :class:`substrax.layout.Layout`); unannotated variables follow a substrax strategy.
Models are created inside ``jax.jit`` with the planned output shardings, so no device ever
holds a whole model. The model remembers its plan: the optimizer, the train steps and the
report take it from there. Pretrained safetensors weights load straight into the planned
shardings (:func:`load_weights`) and are written back (:func:`save_weights`).
``substrax_flax.planner`` plans your own models for the planner; :func:`compile_for` (and
``python -m substrax_flax.compile``) compiles a model's init and step for a TPU slice that
this machine does not have.
"""

from substrax_flax._checkpoint import Checkpointer as Checkpointer
from substrax_flax._checkpoint import CheckpointWarning as CheckpointWarning
from substrax_flax._checkpoint import DirectoryLocked as DirectoryLocked
from substrax_flax._compile import CompileRefused as CompileRefused
from substrax_flax._compile import ProgramMemory as ProgramMemory
from substrax_flax._compile import TargetReport as TargetReport
from substrax_flax._compile import compile_for as compile_for
from substrax_flax._create import create_sharded_model as create_sharded_model
from substrax_flax._create import get_shardings as get_shardings
from substrax_flax._create import plan_model as plan_model
from substrax_flax._create import shard_model as shard_model
from substrax_flax._decode import DecodeStep as DecodeStep
from substrax_flax._decode import make_decode_step as make_decode_step
from substrax_flax._eval import EvalStep as EvalStep
from substrax_flax._eval import PipelineEvalStep as PipelineEvalStep
from substrax_flax._eval import make_eval_step as make_eval_step
from substrax_flax._experts import MixtureOfExperts as MixtureOfExperts
from substrax_flax._experts import RouterBias as RouterBias
from substrax_flax._generate import generate as generate
from substrax_flax._generate import sampler as sampler
from substrax_flax._nonfinite import NonFiniteWarning as NonFiniteWarning
from substrax_flax._optimizer import create_sharded_optimizer as create_sharded_optimizer
from substrax_flax._pipeline_step import PipelineTrainStep as PipelineTrainStep
from substrax_flax._pipeline_step import Stages as Stages
from substrax_flax._plan import ModelPlan as ModelPlan
from substrax_flax._remat import remat as remat
from substrax_flax._report import ShardingReport as ShardingReport
from substrax_flax._report import sharding_report as sharding_report
from substrax_flax._resolve import VariableSharding as VariableSharding
from substrax_flax._safetensors import NonFiniteWeightsWarning as NonFiniteWeightsWarning
from substrax_flax._step_plan import Decision as Decision
from substrax_flax._step_plan import ParamStep as ParamStep
from substrax_flax._step_plan import StepPlan as StepPlan
from substrax_flax._train import TrainStep as TrainStep
from substrax_flax._train import make_train_step as make_train_step
from substrax_flax._weights import KeyMap as KeyMap
from substrax_flax._weights import Target as Target
from substrax_flax._weights import WeightsMismatch as WeightsMismatch
from substrax_flax._weights import WeightsPlan as WeightsPlan
from substrax_flax._weights import load_weights as load_weights
from substrax_flax._weights import plan_weights as plan_weights
from substrax_flax._weights import save_tensors as save_tensors
from substrax_flax._weights import save_weights as save_weights

__all__ = [
    "CheckpointWarning",
    "CompileRefused",
    "Checkpointer",
    "Decision",
    "DecodeStep",
    "DirectoryLocked",
    "EvalStep",
    "KeyMap",
    "MixtureOfExperts",
    "RouterBias",
    "ModelPlan",
    "NonFiniteWarning",
    "NonFiniteWeightsWarning",
    "ParamStep",
    "PipelineEvalStep",
    "PipelineTrainStep",
    "Stages",
    "ProgramMemory",
    "ShardingReport",
    "StepPlan",
    "Target",
    "TargetReport",
    "TrainStep",
    "VariableSharding",
    "WeightsMismatch",
    "WeightsPlan",
    "compile_for",
    "create_sharded_model",
    "create_sharded_optimizer",
    "generate",
    "get_shardings",
    "load_weights",
    "make_decode_step",
    "make_eval_step",
    "make_train_step",
    "plan_model",
    "plan_weights",
    "remat",
    "save_tensors",
    "sampler",
    "save_weights",
    "shard_model",
    "sharding_report",
]
