from .icr import ICRDataModule as ICRDataModule
