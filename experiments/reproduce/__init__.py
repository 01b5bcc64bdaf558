"""The papers' claims (HetRoute, OrderMoE) beside what a run, loaded or not, measured."""
