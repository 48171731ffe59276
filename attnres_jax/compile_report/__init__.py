"""Compile-only reports for TPU topologies and the HLO readers behind them."""
