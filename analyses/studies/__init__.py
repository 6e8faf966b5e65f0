"""One-off measurement studies whose numbers the pages quote: the gradient identity of DFPO's
two transforms, the noise budget of a held-out score, TRL's loss under gradient accumulation,
a tandem on a real-vocabulary model, and the main job (`gradlab reproduce`) over seeds with the
reference behind `gradlab reproduce --check`.
"""
