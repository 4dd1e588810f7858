"""Reading and writing: the source layer by layer (layer_source, layer_stream), shards (layer_writer), the output
folder (output) and calibration text and statistics (calibration)."""
