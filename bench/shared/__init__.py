"""What every benchmark section shares: timing and report helpers (common), the run's settings
and ComfyUI (config), seeded random weights (weights), the photographs (photos)."""
