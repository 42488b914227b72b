"""loopspec.runtime: artifacts in — engines per backend, the draft → gate → verify loop, serving."""
