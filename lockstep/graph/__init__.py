"""GraphTrainer: one micro-batch's forward + loss + backward captured as one FX graph.

The captured graph replaces the eager forward/backward at the runtime's step seam
(``ParallelRuntime.loss_and_backward``) when ``training.mode = "graph"``; passes (``lockstep.graph.passes``)
rewrite it without changing numerics unless they say so. See docs/graph.md.
"""
