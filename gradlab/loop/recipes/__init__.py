"""Scripts that own a loop, built on `gradlab.loop.train`.

The main job with its figures and summary (reproduce), its committed reference and the bands of
`gradlab reproduce --check` (reference), `gradlab eval` (evaluation), the variance study
(variance), Proposition 3.1 on real optimizer steps (prop31).

Imports: anything in gradlab.loop; nothing in gradlab.loop imports it.
"""
