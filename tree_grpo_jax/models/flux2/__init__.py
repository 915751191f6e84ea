"""FLUX.2 (dev and klein): its VAE decoder, prompt encoders and transformer."""
