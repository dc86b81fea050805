"""Worker groups: tensor- and pipeline-parallel ranks of one replica over torch.distributed."""
