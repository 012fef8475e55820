"""Reading offline W&B runs back in tests."""

import struct


def wandb_records(path):
    """Records of an offline run's `.wandb` file (a LevelDB-style log of protobuf records: 32 KiB blocks,
    7-byte record headers, after a 7-byte file header); wandb no longer ships a reader."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, buf = open(path, "rb").read(), 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:  # block padding
            pos += left
            continue
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST fragment
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record
