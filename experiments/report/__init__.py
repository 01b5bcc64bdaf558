"""Rendering a run: summary.json, report.md, its headline and plots, from the raw records."""
