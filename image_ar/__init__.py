"""Image autoregressive models on the shared decoding core: LlamaGen (raster order) today."""
