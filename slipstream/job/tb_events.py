"""TensorBoard event files written with the `tensorboard` package alone: the scalars, text and hyperparameter
summaries the job's tracker writes (slipstream/job/tracking.py), in the records `torch.utils.tensorboard`'s
SummaryWriter writes for them. That writer (with its hparams) imports torch, which a job's driver otherwise
never needs: 1.6 CPU-s and a few hundred MB in every cluster job's driver process; this one imports in 0.3."""

from __future__ import annotations

import time

from tensorboard.compat.proto.event_pb2 import Event, SessionLog
from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
from tensorboard.compat.proto.tensor_pb2 import TensorProto
from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2
from tensorboard.plugins.hparams import metadata as hparams_metadata
from tensorboard.plugins.text.plugin_data_pb2 import TextPluginData
from tensorboard.summary.writer.event_file_writer import EventFileWriter


class EventFile:
    """One new event file in `log_dir` (`events.out.tfevents.<second>.<host>.<pid>.<n>`). `purge_step`:
    TensorBoard's readers discard the events at or after that step from the files before this one (a
    version trained again after a restart)."""

    def __init__(self, log_dir: str, purge_step: int | None = None, flush_secs: int = 10) -> None:
        self._writer = EventFileWriter(log_dir, max_queue_size=10, flush_secs=flush_secs)
        if purge_step is not None:
            self._add(Event(step=purge_step, file_version="brain.Event:2"))
            self._add(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))

    def _add(self, event: Event) -> None:
        event.wall_time = time.time()
        self._writer.add_event(event)

    def _summary(self, summary: Summary, step: int = 0) -> None:
        self._add(Event(summary=summary, step=int(step)))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._summary(Summary(value=[Summary.Value(tag=tag, simple_value=float(value))]), step)

    def add_text(self, tag: str, text: str, step: int = 0) -> None:
        """Shown by TensorBoard's text plugin under `<tag>/text_summary`."""
        plugin = SummaryMetadata.PluginData(
            plugin_name="text", content=TextPluginData(version=0).SerializeToString()
        )
        tensor = TensorProto(
            dtype="DT_STRING",
            string_val=[text.encode()],
            tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]),
        )
        value = Summary.Value(
            tag=f"{tag}/text_summary", metadata=SummaryMetadata(plugin_data=plugin), tensor=tensor
        )
        self._summary(Summary(value=[value]))

    def add_hparams(self, hparams: dict[str, int | float | str | bool]) -> None:
        """The hparams plugin's three summaries for this run: the experiment (each name and its type), the
        session's values, and its end (success)."""
        infos, start = [], plugin_data_pb2.SessionStartInfo()
        for name, value in hparams.items():
            if isinstance(value, bool):
                start.hparams[name].bool_value = value
                kind = "DATA_TYPE_BOOL"
            elif isinstance(value, int | float):
                start.hparams[name].number_value = value
                kind = "DATA_TYPE_FLOAT64"
            else:
                start.hparams[name].string_value = str(value)
                kind = "DATA_TYPE_STRING"
            infos.append(api_pb2.HParamInfo(name=name, type=api_pb2.DataType.Value(kind)))
        end = plugin_data_pb2.SessionEndInfo(status=api_pb2.Status.Value("STATUS_SUCCESS"))
        for tag, data in (
            (hparams_metadata.EXPERIMENT_TAG, {"experiment": api_pb2.Experiment(hparam_infos=infos)}),
            (hparams_metadata.SESSION_START_INFO_TAG, {"session_start_info": start}),
            (hparams_metadata.SESSION_END_INFO_TAG, {"session_end_info": end}),
        ):
            content = plugin_data_pb2.HParamsPluginData(version=hparams_metadata.PLUGIN_DATA_VERSION, **data)
            plugin = SummaryMetadata.PluginData(
                plugin_name=hparams_metadata.PLUGIN_NAME, content=content.SerializeToString()
            )
            self._summary(
                Summary(value=[Summary.Value(tag=tag, metadata=SummaryMetadata(plugin_data=plugin))])
            )

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
