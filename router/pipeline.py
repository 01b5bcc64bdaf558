"""A dense part that moves: EdgeShard's pipeline, the token's activations going stage to stage.

With `dense: pipeline` (the mesh's `dense.pipelines`, from orchestrator.placement.edgeshard)
MoE layer l of a request runs on its pipeline's stage node s_l: its dense part (attention over
the layer's KV cache, which lives there, norm, gate) and its experts, all of which s_l holds.
On the emulated timeline, per layer:

1. **hop**: when the stage changes, the token group's rows (activations of the wire's dtype)
   leave the previous stage on *its* link to s_l (`POST /v1/hop` there, or this node's own
   shaper): the pair's FIFO and the sender's uplink, as any message it sends;
2. **dense**: the layer's share of the dense FLOPs on s_l's device (not the home's);
3. **experts**: one `forward` to s_l that arrives when 1 and 2 say and whose answer is not
   shaped back (the result stays on s_l for the next layer: `MeshTransport.forward_at`), or
   the home's own in-process path when s_l is the home; the stage's queue, loads and compute are
   the node's own.

After the last layer the rows hop back home, where the head picks the next token (the
embedding and head run at home). The home still computes the real values in torch (the
weights and the KV cache tensors are here); what moves is the timeline, charged on the nodes
and links where EdgeShard's pipeline would charge it. A request takes the pipeline that is
quickest from its home by the mesh's priors (`choose`). The KV cache a context token holds
per layer (`ModelProfile.kv_bytes_per_token`) sits on that layer's stage: `kv_bytes_per_token`
says how much per node. The app shaper only: tc delays bytes in the kernel and computes no
arrival for a hop (the node answers 409).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from moe.vocab import FULL_PRECISION
from netem.timing import now as clock_now
from services.wire import (
    ACTIVATION_BYTES,
    DTYPES,
    ForwardResponse,
    Group,
    Work,
    encode_tensor,
    rows_of,
)

from .records import ChoiceRecord, Failure, LayerRecord, TokenRecord
from .transport import RETRYABLE, MeshTransport, is_bug

__all__ = ["Pipeline", "kv_bytes_per_token"]


def kv_bytes_per_token(stages: Sequence[str], per_layer: int) -> dict[str, int]:
    """KV cache bytes one context token holds on each node of a pipeline (per_layer bytes for
    every layer whose stage it is)."""
    return {node: layers * per_layer for node, layers in Counter(stages).items()}


class Pipeline:
    """Runs MoE layers on their stages (module docstring); one per dispatcher."""

    def __init__(self, dispatcher: Any, dense_flops_per_layer: Any) -> None:
        self.mesh = dispatcher.mesh
        self.transport: MeshTransport = dispatcher.transport
        self.home = dispatcher.home
        self.dense_flops = dense_flops_per_layer  # (rows, context) -> FLOPs of one layer
        self.dtype = dispatcher.settings.wire_dtype
        self.row_bytes = dispatcher.shape.d_model * ACTIVATION_BYTES[self.dtype]
        self.timeout_s = dispatcher.settings.token_ms / 1e3
        self.tiers = {(r.layer, r.expert, r.node): r.tier for r in self.mesh.placement.replicas
                      if r.variant == FULL_PRECISION}

    def choose(self) -> tuple[str, ...]:
        """The pipeline quickest from this home by the mesh's priors: one decode token's hops
        (one row, through the access links too) and dense FLOPs on each stage (the stage's
        queues are not known ahead)."""
        flops = self.dense_flops(1, 1)

        def cost(stages: tuple[str, ...]) -> float:
            ms, where = 0.0, self.home
            for stage in (*stages, self.home):
                if stage != where:  # the link and the access links each side of it
                    ms += (self.mesh.link(where, stage).tx_ms(self.row_bytes)
                           + self.mesh.nodes[where].prior.uplink_ms(self.row_bytes)
                           + self.mesh.nodes[stage].prior.downlink_ms(self.row_bytes))
                where = stage
            return ms + sum(1e3 * flops / self.mesh.nodes[s].prior.flops_per_s for s in stages)

        return min(self.mesh.pipelines, key=lambda p: (cost(p), p))

    async def hop(self, src: str, dst: str, rows: int, recs: list[TokenRecord],
                  at: float, order: str = "") -> float:
        """The rows from src to dst leaving at `at`; when they arrive (emulated). Each row's
        bytes count as its token's traffic. `order`: the request's name (`PipelineRunner`):
        two requests' rows leaving one stage at one instant take its uplink in that order."""
        if src == dst:
            return at
        nbytes = rows * self.row_bytes
        arrive = await self.transport.hop(src, dst, nbytes, at, self.timeout_s,
                                          self.mesh.nodes[dst].prior.downlink_mbit is not None,
                                          order)
        for rec in recs:
            if rec.layers:
                rec.layers[-1].bytes_out += self.row_bytes
        return arrive

    async def run_layer(self, layer: int, stage: str, where: str, x: Tensor, idx: Tensor,
                        w: Tensor, recs: list[TokenRecord], clock: Any, context: int,
                        order: str = "") -> tuple[Tensor, float]:
        """Layer `layer` of the group on `stage`, its rows now at `where` on the clock; the
        MoE output and the dense part's emulated seconds. A failure fails every row with the
        stage named (EdgeShard keeps no other copy of the layer on this pipeline)."""
        rows = x.shape[0]
        start = clock.at
        for rec in recs:
            rec.layers.append(LayerRecord(layer, nodes=(stage,)))
        try:
            arrive = await self.hop(where, stage, rows, recs, clock.at, order)
            dense = self.dense_flops(rows, context) / self.mesh.nodes[stage].prior.flops_per_s
            ready = arrive + dense
            work, cpu = self._work(layer, stage, idx, w)
            res = await self._forward(stage, layer, x, work, ready)
        except (*RETRYABLE, LookupError) as exc:
            why = f"pipeline stage {stage}: {exc}" if not is_bug(exc) else f"peer bug: {exc}"
            for rec in recs:
                rec.fail_unreachable(Failure(layer, int(idx[0, 0]), (stage,), (), why))
            clock.at = max(clock.at, clock_now())
            return x.new_zeros(x.shape), 0.0
        t = res.timing
        done = ready + (t.queue_ms + t.load_ms + t.compute_ms) / 1e3
        clock.at = done
        y = rows_of(res.ys[0], self.dtype, rows, x.shape[1]).float()
        link = arrive - start
        for r, rec in enumerate(recs):
            lay = rec.layers[-1]
            lay.emulated_ms = (done - start) * 1e3
            lay.link_ms, lay.queue_ms = link * 1e3, t.queue_ms
            lay.load_ms, lay.compute_ms = t.load_ms, t.compute_ms
            lay.latency_ms = lay.emulated_ms
            for e in idx[r].tolist():
                rec.choices.append(ChoiceRecord(layer, e, e, stage, FULL_PRECISION, "exact",
                                                True, cpu[(layer, e)]))
        return y.to(x.dtype), dense

    def _work(self, layer: int, stage: str, idx: Tensor, w: Tensor
              ) -> tuple[tuple[tuple[Work, ...], ...], dict[tuple[int, int], bool]]:
        cpu: dict[tuple[int, int], bool] = {}
        work = []
        for experts, weights in zip(idx.tolist(), w.tolist(), strict=True):
            for e in experts:
                tier = self.tiers.get((layer, e, stage))
                if tier is None:
                    raise LookupError(f"it holds no fp16 replica of expert {e} of layer {layer}")
                cpu[(layer, e)] = tier == "cpu"
            work.append(tuple(Work(e, FULL_PRECISION, float(g))
                              for e, g in zip(experts, weights, strict=True)))
        return tuple(work), cpu

    async def _forward(self, stage: str, layer: int, x: Tensor, work, ready: float
                       ) -> ForwardResponse:
        """The layer's work on its stage, arrived at `ready`: the home's rows travel as a
        tensor in-process, another stage's as the wire's bytes (as the dispatcher's groups)."""
        rows = x.to(DTYPES[self.dtype]) if stage == self.home else encode_tensor(x, self.dtype)
        return await self.transport.forward_at(stage, [Group(layer, self.dtype, rows, work)],
                                               ready, self.timeout_s)
