"""The GPU: a projection of real-size model calls on an H200 from meta tensors (projection,
projected_calls), their measurement with CUDA events (measured_calls), the summary of both, and
the one-call run on the lent machine (run.sh, prepare.sh, rehearsal.sh)."""
