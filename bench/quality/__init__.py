"""Quality on the trained fixtures: the section (ToMA against ToMeSD, ToDo and EasyCache through
ComfyUI's sampler), its data, models, metrics, baselines, plots, the training and the card."""
