"""The paper's comparators: Hyper-Connections and mHC."""
