"""Fast conversion options for tests on the tiny models: calibration on windows of the text and the closed forms
alone. The defaults (teacher samples, per-layer reconstruction) are the best measured and slower."""

FAST = {"calib_source": "text", "reconstruct_steps": 0}
