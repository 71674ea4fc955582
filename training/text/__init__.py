"""Text cleaning, segmentation and stop words."""
