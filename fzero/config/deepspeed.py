"""The DeepSpeed JSON config keys fzero reads, with DeepSpeed 0.19's defaults, declared as one schema.

Three kinds of keys:

- keys fzero implements (the batch triad, `zero_optimization.stage`, `fp16`, `bf16`, `optimizer`, `scheduler`,
  `gradient_clipping`, `steps_per_print`, `wall_clock_breakdown`, the monitors `tensorboard`, `wandb`,
  `csv_monitor` and `comet`, ...): DeepSpeed's meaning and default;
- keys that tune how DeepSpeed schedules its communication: `overlap_comm` (each unit's gradient reduction overlaps the
  backward; unset, decided for the mesh: `fzero.sharding.units.overlap_pays`) and `reduce_bucket_size` (with it, the
  most gradient elements in flight) take effect through `fzero.GatherPolicy`, as do stage 3's prefetch, persistence and
  live-parameter bounds; those for DeepSpeed's own buckets and copies (`allgather_bucket_size`, `contiguous_gradients`,
  ...) have no effect, because fzero's unit of communication is the unit of its flat buffer (one collective per unit):
  values are still checked;
- known features fzero does not implement (1-bit optimizers, AMP, pipeline/tensor/sequence parallelism, ...): only their
  disabled value is accepted, anything else is an `UnsupportedConfigError` naming the key.

ZeRO++ (`zero_hpz_partition_size`, `zero_quantized_weights`, `zero_quantized_nontrainable_weights`,
`zero_quantized_gradients`) and MiCS (`mics_shard_size`, `mics_hierarchical_params_gather`) act at stage 3, as in
DeepSpeed, and are ignored with a `ConfigWarning` below it; `fzero.config.zeropp.zero_mesh_shape` and
`zeropp_arguments` turn them into the mesh and the `fzero.zero3` arguments (docs/hybrid.md, "From a DeepSpeed
config").

`fzero_metrics` and `fzero_precision` are fzero's own blocks (DeepSpeed ignores them): the JSONL metrics file and
the shape of a dense transformer for the tokens/s and TFLOPS estimate (see `fzero.metrics`); whether the fp32 master
starts from the weights rounded to the compute dtype, as DeepSpeed's does (`fzero.precision.round_params`).

`comms_config.timeout` (seconds) is the collectives' timeout. DeepSpeed 0.19 has no config key for it, only
`deepspeed.init_distributed(timeout=timedelta)` and the `DEEPSPEED_TIMEOUT` environment variable (minutes); the
block takes its name from the attribute DeepSpeed keeps its communication settings in (`DeepSpeedConfig.
comms_config`), the field that of `init_distributed`'s argument. DeepSpeed ignores the block.
"""

from __future__ import annotations

import warnings
from typing import Any

from .autocast import AUTOCAST, autocast_top_checks
from .data_efficiency import CURRICULUM_LEGACY, DATA_EFFICIENCY
from .monitors import COMET, CSV_MONITOR, TENSORBOARD, WANDB
from .offload import AIO, OFFLOAD_OPTIMIZER, OFFLOAD_PARAM, check_offload
from .optimizers import BETA, OPTIMIZER
from .schema import (
    REQUIRED,
    Bool,
    ConfigError,
    ConfigWarning,
    Every,
    Field,
    Int,
    Nullable,
    Num,
    PerGroup,
    Section,
    Str,
    Tagged,
    off,
)
from .zeropp import zeropp_checks, zeropp_top_checks

__all__ = ["SCHEMA"]

MOOT = "no effect: fzero reduces and gathers one flat buffer per unit, in one collective each"
REUSE = (
    "stage 3 keeps a unit gathered from its forward into its backward when fewer elements than this are gathered "
    "between the two (DeepSpeed's rule, counted over fzero's units; 1e9, DeepSpeed's default, keeps every unit of a "
    "model under half a billion elements: a gather fewer per unit and step, the whole model gathered at the "
    "forward's end). Unset: 0, stage 3's least memory (every unit gathered again but the last)"
)
GATHER = "stage 3 gathers one unit at a time: 0 disables prefetching (else one unit ahead); see fzero.GatherPolicy"
INT_MAX = 2**63 - 1
DTYPES = ("fp32", "fp16", "bf16")
_DTYPE_NAMES = ("fp32", "fp16", "bf16", "float32", "float16", "bfloat16")


def _feature(reason: str, flag: str = "enabled", **fields: Field) -> Section:
    """A DeepSpeed feature block fzero does not implement: accepted only while `flag` is false."""
    return Section({flag: Field(Bool(), False, unsupported=reason), **fields}, open=True)


def _removed(feature: str) -> Field:
    """A block of a feature DeepSpeed 0.19.8 has removed: refused wherever present, as DeepSpeed refuses it (ignored,
    the model would silently train without it)."""
    return Field(Nullable(Section({}, open=True)), None, unsupported=feature, supported=lambda v: v is None)


# ----------------------------------------------------------------------------------------------------------- fp16
def _fp16_checks(values: dict[str, Any], path: str) -> None:
    if (
        values["enabled"]
        and values["loss_scale"] == 0
        and values["min_loss_scale"] > 2.0 ** values["initial_scale_power"]
    ):
        raise ConfigError(
            f"{path}.min_loss_scale",
            f"min_loss_scale {values['min_loss_scale']:g} exceeds the initial scale 2**{values['initial_scale_power']}",
        )


FP16 = Section(
    {
        "enabled": Field(Bool(), False),
        "auto_cast": Field(Bool(), False, effect="cast floating-point inputs of engine(...) to fp16"),
        "loss_scale": Field(Num(0, 3e38), 0, effect="0: dynamic loss scaling; > 0: a static scale"),
        "initial_scale_power": Field(Int(0, 127), 16),
        "loss_scale_window": Field(Int(1), 1000),
        "hysteresis": Field(Int(1), 2),
        "consecutive_hysteresis": Field(Bool(), False),
        "min_loss_scale": Field(Num(0, 3e38, low_open=True), 1),
        "fp16_master_weights_and_grads": off("master weights and gradients are kept in fp32"),
    },
    checks=(_fp16_checks,),
)

BF16 = Section(
    {
        "enabled": Field(Bool(), False),
        "immediate_grad_update": Field(Bool(), False, effect="no effect: gradients are accumulated in fp32"),
        "check_grad_overflow": Field(Bool(), True, effect="skip steps with inf/nan gradients (every stage)"),
        "bf16_master_weights_and_grads": Field(
            Bool(), False, effect="bf16 master weights and gradients, float32 arithmetic (fzero.optim.stored_in)"
        ),
        "bf16_optimizer_states": Field(Bool(), False, effect="with bf16_master_weights_and_grads: bf16 state too"),
    }
)


# -------------------------------------------------------------------------------------------------- zero_optimization
def _zero_coerce(value: Any) -> dict[str, Any] | None:
    if isinstance(value, bool):  # DeepSpeed's legacy form: true means stage 1
        return {"stage": 1 if value else 0}
    return None


def _zero_checks(values: dict[str, Any], path: str) -> None:
    if values["allgather_bucket_size"] % 2:
        raise ConfigError(f"{path}.allgather_bucket_size", "must be a multiple of 2 (DeepSpeed's rule)")
    check_offload(values, path)
    zeropp_checks(values, path)


ZERO = Section(
    {
        "stage": Field(Int(0, 3), 0),
        "contiguous_gradients": Field(Bool(), True, effect=MOOT),
        "reduce_scatter": Field(Bool(), True, effect=MOOT),
        "reduce_bucket_size": Field(
            Int(1),
            500_000_000,
            effect="with overlap_comm, the most gradient elements in "
            "flight (fzero.GatherPolicy.reduce_bucket_elements)",
        ),
        "use_multi_rank_bucket_allreduce": Field(Bool(), True, effect=MOOT),
        "allgather_partitions": Field(Bool(), True, effect=MOOT),
        "allgather_bucket_size": Field(Int(1), 500_000_000, effect=MOOT),
        "overlap_comm": Field(
            Nullable(Bool()),
            None,
            effect="each unit's gradient reduction overlaps the backward "
            "(fzero.GatherPolicy.overlap_reduce); null: decided for the mesh "
            "(fzero.sharding.units.overlap_pays: on for several processes)",
        ),
        "load_from_fp32_weights": Field(Bool(), True, effect="no effect (checkpoints hold fp32 master weights)"),
        "elastic_checkpoint": Field(Bool(), False, effect="no effect (fzero's checkpoints reshard on load)"),
        "offload_optimizer": Field(
            OFFLOAD_OPTIMIZER,
            effect="device 'cpu': optimizer step on the CPU; 'nvme': its state in swap files (fzero.Offload)",
        ),
        "offload_param": Field(OFFLOAD_PARAM),
        "sub_group_size": Field(Int(1), 1_000_000_000, effect=MOOT),
        "stage3_prefetch_bucket_size": Field(Int(0), 50_000_000, effect=GATHER),
        "stage3_param_persistence_threshold": Field(
            Int(0),
            100_000,
            effect="units this small stay gathered; modules this small join the unit around them where "
            "fzero.layout.Auto picks units module by module (a model without an nn.ModuleList)",
        ),
        "stage3_model_persistence_threshold": Field(Int(0), INT_MAX, effect=MOOT),
        "stage3_max_live_parameters": Field(Int(0), 1_000_000_000, effect="bounds the gathered elements alive"),
        "stage3_max_reuse_distance": Field(Nullable(Int(0)), None, effect=REUSE),
        "stage3_gather_16bit_weights_on_model_save": Field(
            Bool(),
            False,
            effect="stage 3: engine.save_16bit_model gathers the parameters and saves (else it saves "
            "nothing and returns False, as DeepSpeed)",
        ),
        "stage3_module_granularity_threshold": Field(Int(0), 0, effect=MOOT),
        "ignore_unused_parameters": Field(
            Bool(), True, unsupported="raising on unused parameters (they get zero gradients)", effect="always true"
        ),
        "round_robin_gradients": Field(Bool(), False, effect=MOOT),
        "memory_efficient_linear": Field(Bool(), True, effect=MOOT),
        "enable_sanity_checks": Field(Bool(), False, effect="no effect"),
        "zero_hpz_partition_size": Field(
            Int(0), 1, effect="stage 3, N > 1: ZeRO++ hpZ, fzero.zero3(hpz=True) on a (W / N, N) mesh; 0, 1: off"
        ),
        "zero_quantized_weights": Field(
            Bool(), False, effect="stage 3: ZeRO++ qwZ, every unit's gather in int8 (zero3(qwz=True, qwz_frozen=True))"
        ),
        "zero_quantized_nontrainable_weights": Field(
            Bool(), False, effect="stage 3: frozen parameters' unit gathers in int8 (fzero.zero3(qwz_frozen=True))"
        ),
        "zero_quantized_gradients": Field(
            Bool(),
            False,
            effect="stage 3, several nodes (LOCAL_WORLD_SIZE < WORLD_SIZE): ZeRO++ qgZ, fp32 within "
            "a node, int8 across nodes (fzero.zero3(qgz=('replicate', 'shard')) on the node mesh); one node: no "
            "effect, as in DeepSpeed",
        ),
        "mics_shard_size": Field(
            Int(), -1, effect="stage 3, S > 0: MiCS, fzero.zero3(hybrid=True) on a (W / S, S) mesh; <= 0: off"
        ),
        "mics_hierarchical_params_gather": Field(
            Bool(), False, effect="with MiCS: how the gather is scheduled, the same values (no effect in fzero)"
        ),
        "log_trace_cache_warnings": Field(Bool(), False, effect="no effect"),
    },
    aliases={
        "cpu_offload": "offload_optimizer",
        "cpu_offload_param": "offload_param",
        "prefetch_bucket_size": "stage3_prefetch_bucket_size",
        "param_persistence_threshold": "stage3_param_persistence_threshold",
        "model_persistence_threshold": "stage3_model_persistence_threshold",
        "max_live_parameters": "stage3_max_live_parameters",
        "max_reuse_distance": "stage3_max_reuse_distance",
        "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    },
    coerce=_zero_coerce,
    checks=(_zero_checks,),
)


# ------------------------------------------------------------------------------------------------------- scheduler
_PER_GROUP_LR = PerGroup(Num(0))
_SAME = "no effect (fzero's writer: one safetensors file per rank, streamed with its sha256)"
# DeepSpeed 0.19.8's `checkpoint.writer` block (runtime/model_checkpointing): only `decoupled` changes what fzero does
_WRITER = Section(
    {
        "type": Field(Str(("FAST", "PYTHON", "MOCK"), fold=True), "FAST", effect=_SAME,
                      unsupported="the MOCK writer (it writes no checkpoint)", supported=lambda v: v != "MOCK"),
        "io_buffer_size": Field(Int(1), 64 * 2**20, effect=_SAME),
        "io_buffer_double": Field(Bool(), True, effect=_SAME),
        "show_statistics": Field(Bool(), False, effect=_SAME),
        "data_parallel": Field(Nullable(Str(("REPLICA", "SOCKET", "MACHINE"), fold=True)), None,
                               effect="no effect (every rank writes its own shard file)"),
        "io_multiplier": Field(Int(1), 1, effect=_SAME),
        "decoupled": Field(Bool(), False, effect="save_checkpoint returns once the state is copied to host memory; "
                           "a background thread writes it (fzero.save(blocking=False))"),
    }
)  # fmt: skip
_LAST = Field(Int(), -1, unsupported="resuming a schedule from last_batch_iteration (load a checkpoint instead)")
_WARMUP_TYPE = Field(Str(("log", "linear")), "log")


def _warmup(total: bool, max_lr_default: float | None) -> Section:
    fields: dict[str, Field] = {}
    if total:
        fields["total_num_steps"] = Field(Int(1), REQUIRED)
    fields.update(
        {
            "warmup_min_lr": Field(_PER_GROUP_LR, 0.0),
            "warmup_max_lr": Field(Nullable(_PER_GROUP_LR), max_lr_default, effect="null: each group's own lr"),
            "warmup_num_steps": Field(Int(1), 1000),
            "warmup_type": _WARMUP_TYPE,
            "last_batch_iteration": _LAST,
        }
    )
    return Section(fields)


WARMUP_COSINE = Section(
    {
        "total_num_steps": Field(Int(1), REQUIRED),
        "warmup_min_ratio": Field(Num(0, 1), 0.0),
        "warmup_num_steps": Field(Int(1), 1000),
        "cos_min_ratio": Field(Num(0, 1), 0.0001),
        "warmup_type": _WARMUP_TYPE,
        "last_batch_iteration": _LAST,
    }
)

ONE_CYCLE = Section(
    {
        "cycle_min_lr": Field(_PER_GROUP_LR, REQUIRED),
        "cycle_max_lr": Field(_PER_GROUP_LR, REQUIRED),
        "decay_lr_rate": Field(Num(0), 0.0),
        "cycle_first_step_size": Field(Int(1), 2000),
        "cycle_second_step_size": Field(Nullable(Int(0)), None),
        "cycle_first_stair_count": Field(Int(0), 0),
        "cycle_second_stair_count": Field(Nullable(Int(0)), None),
        "decay_step_size": Field(Int(0), 0),
        "cycle_momentum": Field(Bool(), True),
        "cycle_min_mom": Field(PerGroup(BETA), 0.8),
        "cycle_max_mom": Field(PerGroup(BETA), 0.9),
        "decay_mom_rate": Field(Num(0), 0.0),
        "last_batch_iteration": _LAST,
    }
)

SCHEDULER = Tagged(
    {
        "WarmupLR": _warmup(False, None),
        "WarmupDecayLR": _warmup(True, 0.001),
        "WarmupCosineLR": WARMUP_COSINE,
        "OneCycle": ONE_CYCLE,
    },
    unsupported={"LRRangeTest": "the LR range test is not implemented"},
)

# ------------------------------------------------------------------------------------------------ fzero's own block
FZERO_METRICS = Section(
    {
        "jsonl": Field(Nullable(Str()), None, effect="append one JSON line of metrics per optimizer step (rank 0)"),
        "warmup_steps": Field(Int(0), 2, effect="optimizer steps left out of the timings"),
        "seq_length": Field(Nullable(Int(1)), None, effect="tokens per sample: enables tokens/s"),
        "num_layers": Field(Nullable(Int(1)), None, effect="with hidden_size and seq_length: enables TFLOPS"),
        "hidden_size": Field(Nullable(Int(1)), None),
        "activation_checkpointing": Field(Bool(), False, effect="TFLOPS counts 4 passes instead of 3"),
    }
)

FZERO_PRECISION = Section(
    {
        "round_initial_master": Field(
            Bool(),
            False,
            effect="under bf16/fp16: the fp32 master starts from the weights rounded to bf16/fp16, as DeepSpeed's "
            "(it casts the module first); default: from the model's own fp32 weights",
        ),
    }
)


COMMS = Section(
    {
        "timeout": Field(
            Nullable(Num(0, low_open=True)), None,
            effect="seconds a collective waits for the other ranks before it fails with fzero.CollectiveError "
            "(default: the process group's own)",
        ),
    }
)  # fmt: skip


# ------------------------------------------------------------------------------------------------------ autotuning
def _autotuning_warn(values: dict[str, Any], path: str) -> None:
    if values["enabled"]:
        warnings.warn(
            f"{path}.enabled is ignored: fzero trains on. DeepSpeed's engine with it (outside its autotuner too) "
            f"profiles steps {values['start_profile_step']}-{values['end_profile_step']}, writes "
            "autotuning_metric.json and exits the process at the next step; tune with DeepSpeed's "
            "`deepspeed --autotuning` launcher",
            ConfigWarning,
            stacklevel=2,
        )


AUTOTUNING = Section(
    {
        "enabled": Field(Bool(), False, effect="ignored, with a warning (DeepSpeed's engine profiles and exits)"),
        "start_profile_step": Field(Int(0), 3, effect="no effect"),
        "end_profile_step": Field(Int(0), 5, effect="no effect"),
    },
    open=True,
    checks=(_autotuning_warn,),
)


# ------------------------------------------------------------------------------------------------------ top level
def _top_checks(values: dict[str, Any], path: str) -> None:
    if values["fp16"]["enabled"] and values["bf16"]["enabled"]:
        raise ConfigError("bf16.enabled", "fp16 and bf16 cannot both be enabled")
    _bf16_master_checks(values)
    zeropp_top_checks(values)
    autocast_top_checks(values)


def _bf16_master_checks(values: dict[str, Any]) -> None:
    """DeepSpeed 0.19.8's rules (`DeepSpeedConfig._do_error_check`, `ZeROOptimizer._configure_master_weights`)."""
    bf16, zero = values["bf16"], values["zero_optimization"]
    if bf16["bf16_optimizer_states"] and not bf16["bf16_master_weights_and_grads"]:
        raise ConfigError("bf16.bf16_optimizer_states", "requires bf16_master_weights_and_grads to be enabled")
    if not bf16["bf16_master_weights_and_grads"]:
        return
    where = "bf16.bf16_master_weights_and_grads"
    if not bf16["enabled"]:
        raise ConfigError(where, "needs bf16.enabled")
    if zero["stage"] not in (1, 2, 3):
        raise ConfigError(where, "is only supported with ZeRO stage 1, 2 or 3 (DeepSpeed's rule)")
    offload = zero["offload_optimizer"]["device"] == "cpu"
    if not bf16["bf16_optimizer_states"] or offload:
        opt = values["optimizer"]
        cpu_adam = opt is not None and opt["type"] in ("Adam", "AdamW") and not opt["params"]["torch_adam"]
        if not (offload and cpu_adam):
            raise ConfigError(
                where,
                "with float32 optimizer states (bf16_optimizer_states false), or with offload, needs "
                "zero_optimization.offload_optimizer.device 'cpu' and optimizer.type Adam or AdamW (DeepSpeed's CPU "
                "Adam): DeepSpeed's rule",
            )


SCHEMA = Section(
    {
        "train_batch_size": Field(Nullable(Int()), None),
        "train_micro_batch_size_per_gpu": Field(Nullable(Int()), None),
        "gradient_accumulation_steps": Field(Nullable(Int()), None),
        "steps_per_print": Field(Every(Int(1)), None, effect="one console line every N optimizer steps (rank 0)"),
        "wall_clock_breakdown": Field(Bool(), False, effect="forward/backward/step times in the line and the JSONL"),
        "gradient_clipping": Field(
            Num(0),
            1.0,
            effect="global-norm clipping; default 1.0 (DeepSpeed 0.19.3+'s GRADIENT_CLIPPING_DEFAULT); 0 turns it off",
        ),
        "communication_data_type": Field(
            Nullable(Str(_DTYPE_NAMES)), None, effect="dtype gradients are reduced in (default fp32)"
        ),
        "data_types": Section({"grad_accum_dtype": Field(Nullable(Str(_DTYPE_NAMES)), None)}),
        "prescale_gradients": Field(
            Bool(), False, effect="each rank's gradient times 1/world before the sum (fzero.Average(prescale=True))"
        ),
        "gradient_predivide_factor": Field(
            Num(0, low_open=True), 1.0, effect="times 1/f before the sum, f/world after (fzero.Average(predivide=f))"
        ),
        "sparse_gradients": off("sparse gradients"),
        "dataloader_drop_last": Field(Bool(), False, effect="the training_data loader drops a last short batch"),
        "memory_breakdown": off("memory breakdown printing"),
        "dump_state": Field(Bool(), False, effect="no effect"),
        "zero_allow_untested_optimizer": Field(Bool(), False, effect="no effect"),
        "zero_force_ds_cpu_optimizer": Field(Bool(), True, effect="no effect"),
        "seq_parallel_communication_data_type": Field(Nullable(Str(_DTYPE_NAMES)), None, effect="no effect"),
        "sequence_parallel_size": Field(Int(1), 1, unsupported="sequence parallelism"),
        "fp16": FP16,
        "bf16": BF16,
        "data_efficiency": DATA_EFFICIENCY,  # (fzero.config.data_efficiency)
        "curriculum_learning": CURRICULUM_LEGACY,
        "amp": _feature("NVIDIA Apex AMP; use 'bf16' or 'fp16'"),
        "torch_autocast": AUTOCAST,
        "zero_optimization": ZERO,
        "optimizer": Field(Nullable(OPTIMIZER), None),
        "scheduler": Field(Nullable(SCHEDULER), None),
        "flops_profiler": _feature("the FLOPs profiler; fzero_metrics estimates TFLOPS of dense transformers"),
        "tensorboard": TENSORBOARD,
        "wandb": WANDB,
        "csv_monitor": CSV_MONITOR,
        "comet": COMET,
        "comms_logger": _feature("the communication logger; Mesh.record() gives fzero's ledger"),
        "elasticity": _feature("elastic training"),
        "autotuning": AUTOTUNING,
        "eigenvalue": _feature("eigenvalue computation"),
        "progressive_layer_drop": _feature("progressive layer drop"),
        "compression_training": _removed("DeepSpeed's compression library (XTC, ZeroQuant, pruning)"),
        "nebula": _feature("Nebula checkpointing"),
        "compile": Section({"deepcompile": off("DeepCompile")}, open=True),
        "hybrid_engine": _feature("the hybrid engine"),
        "aio": AIO,
        "sparse_attention": Field(
            Nullable(Section({}, open=True)), None, unsupported="sparse attention", supported=lambda v: v is None
        ),
        "pipeline": Section({}, open=True),
        "activation_checkpointing": Section(
            {
                "partition_activations": off("partitioned activation checkpointing"),
                "cpu_checkpointing": off("activation checkpointing to the CPU"),
            },
            open=True,
        ),
        "checkpoint": Section({"writer": Field(Nullable(_WRITER), None)}, open=True),
        "tensor_parallel": Section({"autotp_size": Field(Int(0), 0, unsupported="tensor parallelism")}, open=True),
        "gradient_allreduce_op": Field(
            Str(("mean", "sum")), "mean", unsupported="summing the ranks' gradients instead of averaging them"
        ),
        "managed_gradient_accumulation": Field(
            Bool(), True, unsupported="caller-managed accumulation (fzero's chain counts the micro-steps)"
        ),
        "expert_parallel": _feature("expert parallelism (AutoEP)"),
        "weight_quantization": Field(
            Nullable(
                Section(
                    {
                        key: Field(
                            Nullable(Section({}, open=True)),
                            None,
                            unsupported="weight quantization",
                            supported=lambda v: v is None,
                        )
                        for key in ("quantized_initialization", "post_init_quant")
                    },
                    open=True,
                )
            ),
            None,
        ),
        "use_data_before_expert_parallelism": Field(Bool(), False, effect="no effect (no MoE process groups)"),
        "quantize_training": _removed("Mixture-of-Quantization (MoQ) training"),
        "graph_harvesting": Field(Bool(), False, effect="no effect (accelerator graph capture; the same values)"),
        "timers": Section({}, open=True),
        "log_level": Field(Nullable(Str()), None, effect="no effect (DeepSpeed's logger)"),
        "datastates_ckpt": Field(Nullable(Section({}, open=True)), None, effect="no effect (fzero's checkpoints)"),
        "data_parallel_size": Field(Nullable(Int(1)), None, effect="no effect (sequence parallelism is refused)"),
        "disable_allgather": Field(Bool(), False, effect="no effect (DeepSpeed reads it and never uses it)"),
        "vocabulary_size": Field(Nullable(Int(1)), None, effect="no effect (DeepSpeed warns if not a multiple of 8)"),
        "allgather_size": Field(Int(1), 500_000_000, effect=MOOT),
        "fzero_metrics": FZERO_METRICS,
        "fzero_precision": FZERO_PRECISION,
        "comms_config": COMMS,
    },
    aliases={"bfloat16": "bf16"},
    checks=(_top_checks,),
)
