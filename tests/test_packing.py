"""Rows cut from a token stream get the features seqio's packing gives the same pieces."""

import numpy as np
import seqio
import tensorflow as tf

from sparsetx.data import packing, token_store


def test_packed_features_equal_seqio_packing():
  pieces = [[5, 6, 7], [8, 1], [9, 10, 11, 1]]  # three document pieces filling one 9-token row exactly
  row = token_store.Rows(np.array([sum(pieces, [])], np.int32), np.zeros((1, 9), bool))
  row.starts_NT[0, [0, 3, 5]] = True
  features = packing.packed_features(row)
  dataset = tf.data.Dataset.from_generator(
    lambda: ({"targets": p} for p in pieces), output_signature={"targets": tf.TensorSpec([None], tf.int32)}
  )
  (seqio_row,) = seqio.LMFeatureConverter(pack=True)(dataset, {"targets": 9}).as_numpy_iterator()
  for ours, theirs in [
    ("inputs", "decoder_input_tokens"),
    ("targets", "decoder_target_tokens"),
    ("segment_ids", "decoder_segment_ids"),
    ("positions", "decoder_positions"),
    ("loss_weights", "decoder_loss_weights"),
  ]:
    np.testing.assert_array_equal(features[ours][0], seqio_row[theirs], err_msg=ours)
