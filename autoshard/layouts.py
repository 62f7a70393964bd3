"""Published layouts as values: price the layout you run today next to autoshard's plan.

>>> L = megatron(tp=2, pp=1, microbatch_size=2, recompute="selective")
>>> L.describe()
'megatron:tp=2,pp=1,cp=1,ep=1,virtual_stages=1,microbatch_size=2,schedule=1f1b,recompute=selective,sequence_parallel=True,distributed_optimizer=False'
>>> parse(L.describe()) == L
True
>>> fsdp(tp=8, replicas=2, checkpoint="full").describe()
'fsdp:tp=8,pp=1,cp=1,virtual_stages=1,schedule=1f1b,recompute=full,reshard_after_forward=True,replicas=2'

``autoshard.plan(model, mesh, ..., layout=L)`` prices exactly ``L`` (``autoshard.layout_plans``):

- ``megatron(tp, pp, dp=None, cp=1, ep=1, virtual_stages=1, microbatch_size=1, schedule="1f1b",
  recompute="full"|"selective"|"none", sequence_parallel=True, distributed_optimizer=False, etp=None,
  overlap_grad_reduce=False, decoder_first/last_pipeline_num_layers=None,
  account_for_embedding/loss_in_pipeline_split=False, accumulate_allreduce_grads_in_fp32=False)``:
  Megatron-LM's tensor parallel (column/row-parallel matmul pairs found from the graph, vocab-parallel
  embedding and head, sequence-parallel norms), data parallel with replicated parameters, gradient
  accumulation of ``batch / (dp x microbatch_size)`` microbatches. ``distributed_optimizer=True`` is
  ZeRO-1 (``passes.sharding.storage_forms``: parameters ``R/zero1`` over dp), with and without a
  pipeline: compute copies replicated, the optimizer state and reduced gradients sharded over dp, the
  gradients reduce-scattered and the parameters all-gathered once per step. The step is the schedule's with the
  gradient all-reduces after the backward, or under it with ``overlap_grad_reduce``; a pipeline's
  stages may be uneven, with Megatron-Core's options (``megatron``'s docstring).
- ``fsdp(tp=1, pp=1, cp=1, checkpoint="none", reshard_after_forward=True, replicas=1, ..., ep=1, etp=None)``:
  torchtitan's FSDP2 (parameters, gradients and optimizer state sharded over the data-parallel
  ranks; ``replicas > 1``: HSDP, sharded inside each of ``replicas`` groups, replicated across them)
  with TP, PP, CP and EP as torchtitan applies them.

Mixture-of-experts layers (``autoshard::moe_experts``) run over their own groups of the same ranks:
``ep`` experts split (tokens dispatched by all-to-all), each expert split ``etp`` ways inside (its
intermediate dim; None: tp, Megatron's default; torchtitan's EP takes ``etp=1``), and expert data
parallel over the rest, sharded where the layout shards (FSDP; the distributed optimizer shards their
optimizer state there). The expert groups may cut across the attention's tp, cp and dp groups: Megatron-Core's
parallel folding (``autoshard.layout_meshes``, ``passes.sharding.expert_layout``). Routers stay
replicated over tp. On a dense model ep and etp change nothing but the mesh's axis names.

The mesh's devices are laid out row-major with tp fastest, then cp, then data parallel, then the
pipeline (Megatron's and torchtitan's order; etp fastest, then ep, for the experts): the plan's
mesh is that logical mesh, of the same size as the one given (``planning_mesh``), cut further
where an expert group starts inside an attention group. With a pipeline, each stage's submesh is
(dp, tp), or its folded axes under cp or expert groups (ring attention inside the stages). A layout
that does not fit the mesh or the model is a ``LayoutError`` naming the cause.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Optional

from autoshard.passes.levers import CHECKPOINT_POLICIES
from autoshard.passes.mesh import Mesh
from autoshard.passes.sharding.layout_placements import LayoutAxes, LayoutError

__all__ = ["Layout", "LayoutError", "megatron", "fsdp", "parse", "KINDS"]

KINDS = ("megatron", "fsdp")
_MEGATRON_ONLY = ("sequence_parallel", "distributed_optimizer", "overlap_grad_reduce",
                  "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                  "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
                  "scatter_gather_tensors_in_pipeline", "blocking_p2p", "deepspeed_partitioned_tensors",
                  "accumulate_allreduce_grads_in_fp32")
#: fields ``describe`` leaves out at their default (added after the text form was fixed)
_QUIET_DEFAULTS = {"overlap_grad_reduce": False, "decoder_first_pipeline_num_layers": None,
                   "decoder_last_pipeline_num_layers": None, "account_for_embedding_in_pipeline_split": False,
                   "account_for_loss_in_pipeline_split": False, "scatter_gather_tensors_in_pipeline": True,
                   "blocking_p2p": False, "deepspeed_partitioned_tensors": False,
                   "accumulate_allreduce_grads_in_fp32": False}
_FSDP_ONLY = ("reshard_after_forward", "replicas")


@dataclass(frozen=True)
class Layout:
    """One hand-written layout. ``kind``: "megatron" or "fsdp"; the degrees (``dp`` None: what the
    mesh leaves); ``microbatch_size``: sequences per data-parallel rank per microbatch (None: the
    whole local batch at once for FSDP without a pipeline, 1 with one); ``recompute``: the
    activation-checkpoint policy of every repeated block; the rest as ``megatron`` / ``fsdp`` say.
    Frozen and JSON-able (``to_json`` / ``from_json``, ``describe`` / ``parse``)."""
    kind: str
    tp: int = 1
    pp: int = 1
    dp: Optional[int] = None
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = None
    virtual_stages: int = 1
    microbatch_size: Optional[int] = None
    schedule: str = "1f1b"
    recompute: str = "none"
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    reshard_after_forward: bool = True
    replicas: int = 1
    overlap_grad_reduce: bool = False
    decoder_first_pipeline_num_layers: Optional[int] = None
    decoder_last_pipeline_num_layers: Optional[int] = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    scatter_gather_tensors_in_pipeline: bool = True
    blocking_p2p: bool = False
    deepspeed_partitioned_tensors: bool = False
    accumulate_allreduce_grads_in_fp32: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise LayoutError(f"layout kind {self.kind!r}: choose one of {list(KINDS)}")
        for name in ("tp", "pp", "cp", "ep", "virtual_stages", "replicas"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise LayoutError(f"{self.kind} layout: {name}={v!r}; pass an int >= 1")
        for name in ("dp", "microbatch_size", "etp"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise LayoutError(f"{self.kind} layout: {name}={v!r}; pass an int >= 1 (or None)")
        if self.recompute not in CHECKPOINT_POLICIES:
            raise LayoutError(f"{self.kind} layout: recompute={self.recompute!r}; choose one of "
                              f"{list(CHECKPOINT_POLICIES)}")
        if self.schedule not in ("1f1b", "gpipe", "interleaved-1f1b"):
            raise LayoutError(f"{self.kind} layout: schedule={self.schedule!r}; choose '1f1b', 'gpipe' or "
                              "'interleaved-1f1b' (with virtual_stages= > 1)")
        if self.schedule == "interleaved-1f1b" and self.virtual_stages < 2:
            raise LayoutError("schedule='interleaved-1f1b' runs several stages per rank: pass virtual_stages= >= 2")
        if self.virtual_stages > 1 and self.pp == 1:
            raise LayoutError(f"virtual_stages={self.virtual_stages} needs a pipeline: pass pp= > 1")
        if self.dp is not None and self.dp % self.replicas:
            raise LayoutError(f"replicas={self.replicas} does not divide dp={self.dp}")
        for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise LayoutError(f"{self.kind} layout: {name}={v!r}; pass an int >= 1 (or None: an even split)")
        uneven = (self.decoder_first_pipeline_num_layers, self.decoder_last_pipeline_num_layers,
                  self.account_for_embedding_in_pipeline_split, self.account_for_loss_in_pipeline_split)
        if any(uneven) and self.pp == 1:
            raise LayoutError("decoder_first/last_pipeline_num_layers and account_for_embedding/loss_in_pipeline_split "
                              "shape a pipeline's stages: pass pp= > 1")
        if not isinstance(self.accumulate_allreduce_grads_in_fp32, bool):
            raise LayoutError(f"accumulate_allreduce_grads_in_fp32={self.accumulate_allreduce_grads_in_fp32!r}; pass "
                              "True or False")
        if self.accumulate_allreduce_grads_in_fp32 and self.kind != "megatron":
            raise LayoutError("accumulate_allreduce_grads_in_fp32 is Megatron-LM's option: use layouts.megatron(...), "
                              "or autoshard.MixedPrecision(reduce_dtype=torch.float32) with fsdp")
        if self.deepspeed_partitioned_tensors and not (self.pp > 1 and self.scatter_gather_tensors_in_pipeline):
            raise LayoutError("deepspeed_partitioned_tensors prices how DeepSpeed's pipeline engine gathers stage boundaries "
                              "sent as 1/tp pieces: it needs pp= > 1 and scatter_gather_tensors_in_pipeline=True")
        if (self.decoder_first_pipeline_num_layers is not None and self.account_for_embedding_in_pipeline_split) or (
                self.decoder_last_pipeline_num_layers is not None and self.account_for_loss_in_pipeline_split):
            raise LayoutError("give the first (last) stage's layer count or count the embedding (loss) as a layer of "
                              "the split, not both")

    # ---- degrees and the logical mesh -------------------------------------------------------------
    def data_parallel(self, world: int) -> int:
        """dp for a mesh of ``world`` devices (all stages'); ``LayoutError`` showing the arithmetic when it
        does not fit."""
        rest = self.tp * self.cp * self.pp
        if self.dp is not None:
            if rest * self.dp != world:
                raise LayoutError(f"layout tp*cp*pp*dp = {self.tp}*{self.cp}*{self.pp}*{self.dp} = {rest * self.dp} "
                                  f"!= mesh size {world}: change a degree or the mesh")
            return self.dp
        if world % rest:
            raise LayoutError(f"layout tp*cp*pp = {self.tp}*{self.cp}*{self.pp} = {rest} does not divide the mesh "
                              f"size {world}: change a degree or the mesh")
        dp = world // rest
        if dp % self.replicas:
            raise LayoutError(f"replicas={self.replicas} does not divide dp = {world} / {rest} = {dp}")
        return dp

    def planning_mesh(self, mesh) -> tuple[Mesh, LayoutAxes]:
        """The logical mesh the layout runs on (same devices as ``mesh``, row-major, tp fastest) and
        which of its axes carry what. Without a pipeline: (replicas, dp, cp, tp) with axes of size 1
        dropped, dp, cp and tp cut further where the experts' groups (etp, ep) start
        (``autoshard.layout_meshes``); with one: (pp x submesh[0], *submesh[1:]), the stage planner's
        view (its first axis cut into pp groups, each a stage's submesh: (dp, tp) unless cp or expert
        groups fold it further)."""
        from autoshard.layout_meshes import single_stage_mesh, stage_submesh
        world = Mesh.of(mesh).size
        if self.pp > 1:
            sub, axes = stage_submesh(self, world)
            return Mesh((self.pp * sub.shape[0],) + sub.shape[1:], ("pp_" + sub.axis_names[0],) + sub.axis_names[1:]), \
                axes
        return single_stage_mesh(self, world)

    # ---- levers and schedule --------------------------------------------------------------------
    def accumulation(self, batch: int, world: int) -> int:
        """Microsteps of one step without a pipeline: batch / (dp x microbatch_size)."""
        return self._microbatches(batch, world, default=None)

    def pipeline_microbatches(self, batch: int, world: int) -> int:
        """Pipeline microbatches of one step: batch / (dp x microbatch_size), microbatch_size 1 by default."""
        return self._microbatches(batch, world, default=1)

    def _microbatches(self, batch: int, world: int, default: Optional[int]) -> int:
        dp = self.data_parallel(world)
        mbs = self.microbatch_size if self.microbatch_size is not None else default
        if mbs is None:
            if batch % dp:
                raise LayoutError(f"the global batch {batch} does not split over dp={dp}")
            return 1
        if batch % (dp * mbs):
            raise LayoutError(f"the global batch {batch} is not a multiple of dp x microbatch_size = {dp} x {mbs} = "
                              f"{dp * mbs}: change the batch or microbatch_size")
        return batch // (dp * mbs)

    @property
    def schedule_name(self) -> str:
        """The pipeline schedule's registry name (``passes/pipeline/schedule/registry.py``)."""
        if self.virtual_stages > 1:
            return f"interleaved-1f1b-v{self.virtual_stages}"
        return self.schedule

    @property
    def overlaps_communication(self) -> bool:
        """Whether the layout's runtime overlaps its data-parallel collectives with compute: FSDP2 always
        (prefetched gathers, reduce-scatters under the backward); Megatron-LM with
        ``--overlap-grad-reduce`` (PyTorch DDP's buckets did the same: ``--DDP-impl torch`` in 2021)."""
        return self.kind == "fsdp" or self.overlap_grad_reduce

    @property
    def scatter_gathers_stage_boundaries(self) -> bool:
        """Megatron-LM sends a tensor that crosses a stage cut whole on tp as 1/tp pieces and all-gathers
        it on the receiving stage (``--no-scatter-gather-tensors-in-pipeline`` turns that off)."""
        return self.kind == "megatron" and self.scatter_gather_tensors_in_pipeline

    @property
    def sends_block_the_sender(self) -> bool:
        """Each stage-boundary send is its own blocking call on the sending stage's stream (``blocking_p2p``:
        DeepSpeed's pipeline engine), so a stage pays its sends as well as its receives."""
        return self.kind == "megatron" and self.blocking_p2p

    @property
    def gathers_as_deepspeed(self) -> bool:
        """Stage boundaries sent in pieces are gathered the way DeepSpeed's pipeline engine does
        (``deepspeed_partitioned_tensors``): ``PartitionedTensor.full()`` copies around each all-gather,
        and the sending stage gathers its own output again before its backward."""
        return self.kind == "megatron" and self.deepspeed_partitioned_tensors

    @property
    def keeps_gathered_parameters(self) -> bool:
        """reshard_after_forward's value: FSDP's own; Megatron's distributed optimizer keeps its gathered copies
        from forward to backward (it gathers once per step; here once per accumulation microstep)."""
        return self.reshard_after_forward if self.kind == "fsdp" else False

    # ---- text and JSON ---------------------------------------------------------------------------
    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Layout":
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise LayoutError(f"layout fields {unknown} are unknown; fields are {[f.name for f in fields(cls)]}")
        return cls(**d)

    def describe(self) -> str:
        """``kind:key=value,...`` with the fields this kind takes (``parse`` reads it back); ``etp`` only
        when given, and for fsdp ``ep`` only when > 1."""
        skip = _FSDP_ONLY if self.kind == "megatron" else _MEGATRON_ONLY
        items = [f"{k}={v}" for k, v in asdict(self).items() if k != "kind" and k not in skip
                 and not (k in ("dp", "microbatch_size", "etp") and v is None)
                 and not (k == "ep" and v == 1 and self.kind == "fsdp")
                 and not (k in _QUIET_DEFAULTS and v == _QUIET_DEFAULTS[k])]
        return f"{self.kind}:" + ",".join(items)


def megatron(tp: int = 1, pp: int = 1, dp: Optional[int] = None, cp: int = 1, ep: int = 1, virtual_stages: int = 1,
             microbatch_size: int = 1, schedule: str = "1f1b", recompute: str = "full", sequence_parallel: bool = True,
             distributed_optimizer: bool = False, overlap_grad_reduce: bool = False,
             decoder_first_pipeline_num_layers: Optional[int] = None,
             decoder_last_pipeline_num_layers: Optional[int] = None,
             account_for_embedding_in_pipeline_split: bool = False,
             account_for_loss_in_pipeline_split: bool = False,
             scatter_gather_tensors_in_pipeline: bool = True, etp: Optional[int] = None,
             blocking_p2p: bool = False, deepspeed_partitioned_tensors: bool = False,
             accumulate_allreduce_grads_in_fp32: bool = False) -> Layout:
    """Megatron-LM's layout (module docstring). ``recompute``: "full" | "selective" | "none".
    ``overlap_grad_reduce``: gradient all-reduces start under the backward (Megatron-LM's
    ``--overlap-grad-reduce``; PyTorch DDP, ``--DDP-impl torch`` in 2021); off by default, as in
    Megatron-Core. The uneven pipeline, with Megatron-Core's names (``layout_plans.layout_stage_starts``):
    ``decoder_first_pipeline_num_layers`` / ``decoder_last_pipeline_num_layers``: the blocks of the first /
    last pipeline rank (split evenly over its virtual stages), the rest split evenly over the others;
    ``account_for_embedding_in_pipeline_split`` / ``account_for_loss_in_pipeline_split``: the embedding /
    the final norm, head and loss count as one block each in the even split (with pp x virtual_stages =
    blocks + 2, the first and last stages hold only the embedding and the head: Llama 3 405B's layout).
    ``scatter_gather_tensors_in_pipeline``: a tensor crossing a stage cut whole on tp travels as 1/tp
    pieces, all-gathered by the receiving stage (Megatron-LM's default). ``blocking_p2p``: every send and
    receive between stages is its own blocking call, one after another on the stage's stream, so the
    sender pays for its sends (DeepSpeed's pipeline engine, which Megatron-DeepSpeed runs: its
    ``TrainSchedule`` issues SendGrad, RecvActivation, RecvGrad and SendActivation as separate
    instructions, each ``p2p.send`` / ``p2p.recv``, i.e. ``dist.send`` / ``dist.recv`` without
    ``async_op``; deepspeed/runtime/pipe/schedule.py and p2p.py). Megatron-LM batches a stage's send and
    receive into one exchange (``send_forward_recv_backward``), which the default prices. ``ep`` / ``etp``: the MoE layers'
    expert-parallel and expert-tensor-parallel sizes (``etp`` None: tp, Megatron's default), carved from the
    same tp x cp x dp ranks (parallel folding: ``autoshard.layout_meshes``).
    ``accumulate_allreduce_grads_in_fp32``: Megatron-LM's ``--accumulate-allreduce-grads-in-fp32`` (forced
    on with ``--bf16``, megatron/arguments.py; DeepSpeed's ``BF16_Optimizer`` does the same): every
    microbatch's 16-bit gradient is added into an fp32 main gradient, the data-parallel all-reduce (or the
    distributed optimizer's reduce-scatter) runs on those fp32 gradients, and they are held at 4 bytes
    per element. Priced as ``MixedPrecision(reduce_dtype=torch.float32, accumulate_in_reduce_dtype=True)``
    (``layout_plans.layout_mixed_precision``); off by default, the gradients then accumulated and reduced
    in the model's dtype. ``autoshard.compile`` does not run it (it refuses such a plan)."""
    return Layout("megatron", tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp, virtual_stages=virtual_stages,
                  microbatch_size=microbatch_size, schedule=schedule, recompute=recompute,
                  sequence_parallel=bool(sequence_parallel and tp > 1), distributed_optimizer=distributed_optimizer,
                  overlap_grad_reduce=overlap_grad_reduce,
                  decoder_first_pipeline_num_layers=decoder_first_pipeline_num_layers,
                  decoder_last_pipeline_num_layers=decoder_last_pipeline_num_layers,
                  account_for_embedding_in_pipeline_split=account_for_embedding_in_pipeline_split,
                  account_for_loss_in_pipeline_split=account_for_loss_in_pipeline_split,
                  scatter_gather_tensors_in_pipeline=scatter_gather_tensors_in_pipeline, blocking_p2p=blocking_p2p,
                  deepspeed_partitioned_tensors=deepspeed_partitioned_tensors,
                  accumulate_allreduce_grads_in_fp32=accumulate_allreduce_grads_in_fp32)


def fsdp(tp: int = 1, pp: int = 1, cp: int = 1, checkpoint: str = "none", reshard_after_forward: bool = True,
         replicas: int = 1, dp: Optional[int] = None, microbatch_size: Optional[int] = None, schedule: str = "1f1b",
         virtual_stages: int = 1, ep: int = 1, etp: Optional[int] = None) -> Layout:
    """torchtitan's FSDP2 / HSDP (``replicas``) + TP (sequence parallel, as torchtitan applies it) + PP +
    CP. ``checkpoint``: torchtitan's activation checkpointing ("none" | "selective" | "full" |
    "selective_op"); "selective_op" is torchtitan's selective op AC (``mode="selective"``,
    ``selective_ac_option="op"``: attention and every other ``aten.mm`` output kept, the rest recomputed);
    "selective" is the planner's own selective policy (every matmul and attention output kept).
    ``ep`` / ``etp``: expert parallel as torchtitan applies it (experts split over ep ranks taken from the data-
    parallel, cp and, with ``etp=1``, tp ranks; their weights FSDP-sharded over the rest)."""
    return Layout("fsdp", tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp, virtual_stages=virtual_stages, microbatch_size=microbatch_size,
                  schedule=schedule, recompute=checkpoint, sequence_parallel=tp > 1,
                  reshard_after_forward=reshard_after_forward, replicas=replicas)


def _value(key: str, text: str):
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        return text


def parse(text: str) -> Layout:
    """``"megatron:tp=8,pp=16"`` / ``"fsdp:tp=8,checkpoint=full"`` -> the Layout (the CLI's ``--layout``).
    Keys are the keywords of ``megatron`` / ``fsdp``; ``LayoutError`` names a bad one."""
    kind, _, rest = text.partition(":")
    kind = kind.strip()
    factories = {"megatron": megatron, "fsdp": fsdp}
    if kind not in factories:
        raise LayoutError(f"layout {text!r}: start with one of {[k + ':' for k in KINDS]} (e.g. megatron:tp=8,pp=16)")
    kwargs = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, val = item.partition("=")
        if not eq:
            raise LayoutError(f"layout {text!r}: {item!r} is not key=value")
        kwargs[key.strip()] = _value(key.strip(), val.strip())
    if kind == "fsdp" and "recompute" in kwargs:
        kwargs["checkpoint"] = kwargs.pop("recompute")
    for key in ("sequence_parallel",) if kind == "fsdp" else ():
        kwargs.pop(key, None)  # fsdp: sequence parallel follows tp, as torchtitan applies it
    try:
        return factories[kind](**kwargs)
    except TypeError as e:
        import inspect
        raise LayoutError(f"layout {text!r}: {e}; {kind} takes {list(inspect.signature(factories[kind]).parameters)}") from e

