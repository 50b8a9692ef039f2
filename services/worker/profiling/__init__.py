"""A worker's cost models: profiled at start-up, kept across starts, refined online.

``profiler.py`` times the start-up profile, ``cache.py`` keeps it for the next start when nothing it was
measured on changed, ``refiner.py`` refits the models from the steps the engine times.
"""
