"""Packed training rows for train_embedded.py (--pack): every sample of an image in one row.

A row holds the prefix all of an image's samples share (BOS, "USER: ", the image tokens) once,
then each sample's rest (its prompt after the image, then its target) as a segment. A segment
attends to the prefix and to itself only, at the positions it has alone, so the model computes
for each segment exactly what it computes for the sample alone; the image goes through the
vision tower and the prefix through the decoder once for all of them."""
import numpy as np


class PackedTable:
    def __init__(self, table, image_token_index, n_images):
        """table: a SampleTable (tokens, plen, tlen, image_row); its samples grouped by image."""
        first = table.tokens[0]
        image_at = np.nonzero(first == image_token_index)[0]
        if len(image_at) == 0:
            raise SystemExit("packing: the first sample has no image token")
        P = int(image_at.max()) + 1
        if not (table.tokens[:, :P] == first[:P]).all():
            raise SystemExit("packing: the samples do not share the prefix up to the image")
        by_image = [[] for _ in range(n_images)]
        for k, r in enumerate(table.image_row):
            by_image[int(r)].append(k)
        L = max(P + sum(int(table.tlen[k]) - P for k in ks) for ks in by_image)
        self.prefix, self.max_len, self.samples = P, L, len(table.image_row)
        self.tokens = np.zeros((n_images, L), dtype=np.int64)
        self.pos = np.zeros((n_images, L), dtype=np.int64)
        self.seg = np.full((n_images, L), -1, dtype=np.int64)  # 0 the prefix, k > 0 a sample, -1 padding
        self.target = np.zeros((n_images, L), dtype=bool)
        for r, ks in enumerate(by_image):
            self.tokens[r, :P] = first[:P]
            self.pos[r, :P] = np.arange(P)
            self.seg[r, :P] = 0
            o = P
            for j, k in enumerate(ks):
                p, t = int(table.plen[k]), int(table.tlen[k])
                m = t - P
                self.tokens[r, o:o + m] = table.tokens[k, P:t]
                self.pos[r, o:o + m] = np.arange(P, t)
                self.seg[r, o:o + m] = j + 1
                self.target[r, o + p - P:o + m] = True
                o += m


def packed_mask(seg, torch):
    """[B, L] segment ids -> [B, 1, L, L] bool, True where a query may attend: the prefix and
    its own segment, causally (padding sees the prefix and earlier padding)."""
    L = seg.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=seg.device).tril()
    q, k = seg[:, :, None], seg[:, None, :]
    return (causal & ((k == 0) | (k == q)))[:, None]
