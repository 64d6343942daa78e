"""Datasets in the seeds' formats, read into Samples; images and their pixel-range resizing."""

from grouprl.data.formats import FORMATS, DataError
from grouprl.data.images import open_image, resize_to_pixel_range
from grouprl.data.loading import SampleDataset, load_datasets, load_samples, samples_from_records
from grouprl.data.sample import Sample

__all__ = [
    "FORMATS",
    "DataError",
    "Sample",
    "SampleDataset",
    "load_datasets",
    "load_samples",
    "open_image",
    "resize_to_pixel_range",
    "samples_from_records",
]
