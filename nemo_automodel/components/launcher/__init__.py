"""How the recipe's processes start: torchrun, Slurm ``srun``, or local workers via ``elastic_launch``."""
