"""Speed on the CPU, side by side: the merge kernels, SDXL and Flux blocks at real width, the
diffusion transformer families, a whole SDXL step and whole sampling calls, the output error
of each variant on photographs' token grids (fidelity), and the peers (ToMeSD, ToDo)."""
