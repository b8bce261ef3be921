"""A simulated SGLang worker (a simulator, not a model): step-time profiles, a virtual-time engine, and an
HTTP server that speaks the part of SGLang's API the gateway uses.

- :mod:`loadgen.sim.profiles`: per model/GPU/TP step-time parameters with cited anchor figures.
- :mod:`loadgen.sim.engine`: pure, time-injected continuous-batching scheduler with a radix prefix cache,
  priority scheduling and preemption (usable by a discrete-event fleet simulation).
- :mod:`loadgen.sim.server`: ``python -m loadgen.sim --profile NAME --port P`` runs it over HTTP in real time.
- :mod:`loadgen.sim.calibrate`: closed-loop benchmarks in virtual time; checks profiles against anchors.
"""
