"""Using a trained model: resolve what a path holds (``source``), and the after-training commands built on it."""
