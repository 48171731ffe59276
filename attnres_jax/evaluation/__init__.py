"""The one evaluation path, the paper's depth statistics, figures and run comparisons."""
