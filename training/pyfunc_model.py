"""Entry file of the logged MLflow model ("models from code"): nothing is pickled.

MLflow executes this file when the model is loaded; the code of ``training``
travels with the model (``code_paths``), the weights and vocabulary as artifacts.
"""

import mlflow.models

from training.inference import TextClassifier

mlflow.models.set_model(TextClassifier())
