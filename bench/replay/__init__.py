"""Trace replay benchmark (``pdserve bench``): load a request trace, turn it into real-text
prompts, replay it open-loop against a router at a sweep of rates, and report SLO attainment
and goodput. Modules: ``traces`` (loading, scaling), ``prompts`` (token ids), ``runner``
(load generator), ``records`` (per-request record), ``goodput`` (attainment, goodput),
``plots`` (PNGs), ``cli`` (the command)."""
