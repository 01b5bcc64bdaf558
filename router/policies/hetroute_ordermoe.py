"""hetroute+ordermoe (ours): OrderMoE's similarity substitutes enter HetRoute's joint search
as extra candidates beside the exact replicas, each with its measured penalty and OrderMoE's
expected future cost over the next H layers; the budget and fallback rules stay HetRoute's."""

from __future__ import annotations

from .hetroute import HetRoute

__all__ = ["HetRouteOrderMoE"]


class HetRouteOrderMoE(HetRoute):
    name = "hetroute+ordermoe"
    substitutes_always = True
    lookahead = True
