"""Testing helpers for mlx_kvq: tiny random-weight models (`tiny`, catalogue in
`archs`), scripted models whose greedy output a test chooses (`scripted`),
server subprocesses (`server`: `mlx-kvq serve` and `mlx_lm.server`), exact
references for deepseek_v41's quantized LayerCache (`layer_cache`)."""
