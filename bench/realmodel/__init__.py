"""A real trained diffusion model merged as the pack merges a UNet's attention.

The model: adaptive-terrain-diffusion 0.4.2's bundled consistency-model UNet (MIT; 128x128
heightmaps in one step), its ONNX graph run as torch ops (`onnx_torch.py`), its self-attention
blocks run by `merges.py` unmerged or merged (ToMA, its variants, ToMeSD, ToDo), sampled by the
package's own `TerrainGenerator.generate`. Set up with `bash bench/realmodel/setup.sh` (its own
venv; nothing here is the product's), run with `python -m bench.realmodel` in that venv.
"""
