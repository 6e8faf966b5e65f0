"""What happens when something goes wrong, decided in one place.

Bad options and files are refused naming the thing at fault (errors, untrusted); a non-finite
step stops or is skipped (guard); exit codes (exitcodes, a failed write's from gradlab.atomic)
and pre-emption by signal (preempt) end a run with a defined outcome.

Imports nothing else from gradlab.loop, so every other package may import it.
"""
