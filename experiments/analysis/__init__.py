"""Rows → figures and checks: statistics, paired comparisons, intervals, quality, fidelity and
faithfulness."""
