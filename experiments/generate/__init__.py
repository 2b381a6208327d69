"""Using trained runs, each a command with `main(argv)`:

    speculative.py    decode with a speculative run's target and draft (python -m experiments.generate.speculative)
    text_to_image.py  images from a text-to-image run's DALL-E and VAE (python -m experiments.generate.text_to_image)
"""
