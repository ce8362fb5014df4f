"""The Train tab: a form generated from the config schema, dataset preview, YAML tools, Start and Stop."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import gradio as gr

from rlfactory.errors import UserError
from rlfactory.webui import preview, runner, workspace
from rlfactory.webui import schema_form as sf
from rlfactory.webui.model_picker import ModelPicker
from rlfactory.webui.monitor import pipeline_stages as monitor_pipeline_stages
from rlfactory.webui.monitor import shown_run
from rlfactory.webui.plan_panel import PlanPanel

# Shown first, above the sections, in these rows (they still come from the schema): what to train, and on how
# many GPUs with which strategy (the same `distributed` keys the CLI reads: `rlfactory train` starts torchrun).
ESSENTIAL_ROWS = (
    ("stage", "model.name_or_path", "model.template", "data.dataset"),
    ("distributed.num_processes", "distributed.strategy"),
)
ESSENTIALS = tuple(path for row in ESSENTIAL_ROWS for path in row)
EXAMPLES_DIR = "examples"
FIELDS_PER_ROW = 3
YAML_SUFFIXES = (".yaml", ".yml")


ESSENTIAL_ERRORS = "essentials"  # the field_errors slot under the essential rows


def error_md(exc: Exception) -> str:
    return f"✗ **Error**\n```text\n{exc}\n```"


def _widget_overrides(spec: sf.FieldSpec, datasets: list[str]) -> sf.FieldSpec:
    """Registry-backed choices for dataset names; the named templates for model.template."""
    from rlfactory.render.templates import TEMPLATES

    if spec.path in ("data.dataset", "data.eval_dataset"):
        return dataclasses.replace(spec, kind="multi", choices=tuple(datasets))
    if spec.path == "evaluation.dataset":
        return dataclasses.replace(spec, kind="enum", choices=("", *datasets))
    if spec.path == "model.template":
        return dataclasses.replace(spec, kind="enum", choices=("", *TEMPLATES))
    return spec


def _choice_label(spec: sf.FieldSpec, choice: str) -> tuple[str, str]:
    empty = {"model.template": "(the tokenizer's own)", "evaluation.dataset": "(none)"}
    return (empty.get(spec.path, "(unset)") if choice == "" else choice, choice)


def make_widget(spec: sf.FieldSpec) -> Any:
    """One Gradio input for a schema field: label = YAML key, help = the field's description."""
    common = {"label": spec.key, "info": spec.info, "elem_id": "field-" + spec.path.replace(".", "-")}
    value = sf.default_form_value(spec)
    if spec.kind == "bool":
        return gr.Checkbox(value=value, **common)
    if spec.kind in ("enum", "multi"):
        choices = [_choice_label(spec, c) for c in spec.choices]
        multi = spec.kind == "multi"
        return gr.Dropdown(choices, value=value, multiselect=multi, allow_custom_value=True, **common)
    if sf.blank_means_default(spec):
        return gr.Textbox(value=value, lines=1, placeholder="blank: unset (the default)", **common)
    if spec.kind in ("int", "float"):
        return gr.Number(value=value, precision=0 if spec.kind == "int" else None, **common)
    return gr.Textbox(value=value, lines=1, **common)


SAVED_DIR = "outputs/webui"  # where Save YAML writes by default
_SAVED: list[str] = []  # YAMLs saved by this WebUI process (any path), offered for loading


def example_yamls() -> list[str]:
    """The Load list: the bundled quickstarts first (runnable offline, in stage order), then the YAMLs saved here,
    then the real-model examples."""
    from rlfactory.config.schema import STAGES

    quick = Path(EXAMPLES_DIR) / "quickstart"
    order = {stage: i for i, stage in enumerate(STAGES)}
    quickstarts = sorted((str(p) for p in quick.glob("*.yaml")), key=lambda p: (order.get(Path(p).stem, 99), p))
    saved = [*_SAVED, *(str(p) for p in sorted(Path(SAVED_DIR).glob("*.y*ml")))]
    rest = sorted(str(p) for p in Path(EXAMPLES_DIR).rglob("*.yaml") if quick not in p.parents)
    return list(dict.fromkeys([*quickstarts, *saved, *rest]))


def stop_message(output_dir: str) -> str:
    """Stop the run in ``output_dir``: what happened, or why it was refused, for the page."""
    try:
        return "■ " + runner.stop(output_dir)
    except UserError as exc:
        return error_md(exc)


def save_target(path: str) -> Path:
    """Where Save YAML may write: a .yaml/.yml file inside the workspace, replacing at most an earlier run
    YAML (a mapping with a ``stage`` key), never another file. Raises UserError."""
    import yaml

    target = workspace.current().writable(path, "save to")
    if target.suffix not in YAML_SUFFIXES:
        raise UserError(f"save to '{path}': give a file name ending in .yaml")
    if target.exists():
        try:
            earlier = yaml.safe_load(target.read_text()) if target.is_file() else None
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            earlier = None
        if not (isinstance(earlier, dict) and "stage" in earlier):
            raise UserError(f"save to '{path}': that file exists and is not a run YAML; refused to replace it")
    return target


class TrainTab:
    """Builds the tab; ``specs``/``widgets`` are in schema order and stay aligned."""

    def __init__(self) -> None:
        datasets = preview.registered_datasets()
        self.sections = sf.form_sections()
        for section in self.sections:
            section.fields = [_widget_overrides(f, datasets) for f in section.fields]
        self.specs = sf.all_fields(self.sections)
        self.widgets: dict[str, Any] = {}
        self.stage_groups: dict[str, Any] = {}
        self.accordions: dict[str, Any] = {}
        self.build()

    # ------------------------------------------------------------------ layout
    def _rows(self, specs: list[sf.FieldSpec]) -> None:
        for start in range(0, len(specs), FIELDS_PER_ROW):
            with gr.Row():
                for spec in specs[start : start + FIELDS_PER_ROW]:
                    self.widgets[spec.path] = make_widget(spec)

    def build(self) -> None:
        by_path = {s.path: s for s in self.specs}
        gr.Markdown("Fill the fields (every one is a key of the run YAML), preview the data, then **Start**.")
        for row in ESSENTIAL_ROWS:
            with gr.Row():
                for path in row:
                    self.widgets[path] = make_widget(by_path[path])
        self.model_picker = ModelPicker()  # fills model.name_or_path and model.template
        self.field_errors: dict[str, Any] = {ESSENTIAL_ERRORS: gr.Markdown(visible=False, elem_id="error-essentials")}
        with gr.Accordion("Dataset preview: what the model sees", open=False, elem_id="preview-accordion"):
            with gr.Row():
                self.prev_btn = gr.Button("◀ previous", size="sm", elem_id="preview-prev")
                self.show_btn = gr.Button("Show examples", size="sm", variant="secondary", elem_id="preview-show")
                self.next_btn = gr.Button("next ▶", size="sm", elem_id="preview-next")
                self.page = gr.Number(value=0, visible=False, precision=0)
            self.preview_html = gr.HTML(elem_id="preview-html")
        for section in self.sections:
            rest = [s for s in section.fields if s.path not in ESSENTIALS]
            title = f"{section.name or 'run'}: {section.description}"
            visible = not section.stages or "sft" in section.stages
            with gr.Accordion(
                # the run's own keys, and ppo/grpo's rewards (required there), open from the start
                title,
                open=not section.name or section.name == "reward",
                visible=visible,
                elem_id=f"section-{section.name or 'run'}",
            ) as acc:
                # a Validate/Start error about one of this section's keys shows here, with the section opened
                self.field_errors[section.name] = gr.Markdown(visible=False, elem_id=f"error-{section.name or 'run'}")
                self._rows(rest)
                if section.name == "reward":  # the reward editor (webui.reward_panel), under the section's fields
                    from rlfactory.webui.reward_panel import RewardPanel

                    self.reward_panel = RewardPanel(error_md)
            self.accordions[section.name] = acc
            if section.stages:
                self.stage_groups[section.name] = acc
        self._buttons()

    def _buttons(self) -> None:
        with gr.Row():
            self.validate_btn = gr.Button("Validate", elem_id="btn-validate")
            self.preview_btn = gr.Button("Preview YAML", elem_id="btn-preview-yaml")
            self.start_btn = gr.Button("Start", variant="primary", elem_id="btn-start")
            self.stop_btn = gr.Button("Stop", variant="stop", elem_id="btn-stop")
        self.plan = PlanPanel()  # the memory estimate, next to Start
        with gr.Row():
            self.load_path = gr.Dropdown(
                example_yamls(), label="YAML to load", allow_custom_value=True, elem_id="load-path", scale=3
            )
            self.load_btn = gr.Button("Load YAML", elem_id="btn-load", scale=1)
            self.save_path = gr.Textbox(f"{SAVED_DIR}/run.yaml", label="save to", elem_id="save-path", scale=3)
            self.save_btn = gr.Button("Save YAML", elem_id="btn-save", scale=1)
        self.message = gr.Markdown(elem_id="train-message")
        self.yaml_view = gr.Code(language="yaml", label="run YAML", elem_id="yaml-view", interactive=False)

    # ------------------------------------------------------------------ helpers
    @property
    def inputs(self) -> list[Any]:
        return [self.widgets[s.path] for s in self.specs]

    def raw(self, values: tuple[Any, ...]) -> dict[str, Any]:
        return sf.form_to_raw(self.sections, list(values))

    def stage_visibility(self, stage: str) -> list[Any]:
        return [gr.Accordion(visible=stage in self._section(name).stages) for name in self.stage_groups]

    def _section(self, name: str) -> sf.SectionSpec:
        return next(s for s in self.sections if s.name == name)

    # ------------------------------------------------------------------ handlers
    def on_preview_yaml(self, *values: Any) -> tuple[str, str]:
        try:
            return "", sf.raw_to_yaml(self.raw(values))
        except UserError as exc:
            return error_md(exc), ""

    @property
    def check_outputs(self) -> list[Any]:
        """What Validate and Start answer in: the message, the YAML, each section's error slot and accordion."""
        return [self.message, self.yaml_view, *self.field_errors.values(), *self.accordions.values()]

    def answer(self, message: str, yaml_text: str, error: UserError | None = None) -> list[Any]:
        """Values for ``check_outputs``. An error also shows next to the field it names, in its section opened
        (the top message says where), and the YAML view is emptied: it would show an earlier, valid form."""
        path = sf.error_field(str(error), self.specs) if error else None
        slot = None
        if path is not None:
            slot = ESSENTIAL_ERRORS if path in ESSENTIALS else next(s.section for s in self.specs if s.path == path)
        if error is not None:
            where = f" (shown at `{path}`)" if path else ""
            message = f"✗ **Error**{where}\n```text\n{error}\n```"
        errors = [
            gr.Markdown(f"✗ **{path}**\n```text\n{error}\n```", visible=True)
            if name == slot
            else gr.Markdown(visible=False)
            for name in self.field_errors
        ]
        opened = [gr.Accordion(open=True) if name == slot else gr.skip() for name in self.accordions]
        return [message, yaml_text, *errors, *opened]

    def on_validate(self, *values: Any) -> list[Any]:
        try:
            raw = self.raw(values)
            config, notes = runner.check(raw)
        except UserError as exc:
            return self.answer("", "", exc)
        checked = "".join(f"\n- {note}" for note in notes)
        return self.answer(
            f"✓ valid: stage {config.stage}, output_dir `{config.output_dir}`{checked}", sf.raw_to_yaml(raw)
        )

    def on_save(self, path: str, *values: Any) -> tuple[str, Any]:
        try:
            text = sf.raw_to_yaml(self.raw(values))
            shown = path.strip() or f"{SAVED_DIR}/run.yaml"
            target = save_target(shown)
        except UserError as exc:
            return error_md(exc), gr.skip()
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        if shown not in _SAVED:
            _SAVED.append(shown)
        message = f"✓ saved `{shown}` (run it with `rlfactory train {shown}`)"
        return message, gr.Dropdown(choices=example_yamls())  # the saved file joins the Load list

    def on_load(self, path: str) -> list[Any]:
        return self.form_from(path, f"✓ loaded `{path}`")

    def form_from(self, path: str, note: str) -> list[Any]:
        """Form values, stage sections and a message for the YAML at ``path`` (inputs + stage_groups + message)."""
        from rlfactory.config.loader import read_yaml

        try:
            raw = read_yaml(workspace.current().readable(path or "", "YAML to load"))
            if "stages" in raw:
                raise UserError(
                    f"{path} is a pipeline (`stages:`) and the form edits one run: start it from the Start tab "
                    f"(▶ Start), or with `rlfactory train {path}`"
                )
            raw, converted = sf.form_mapping(raw)
        except UserError as exc:
            return [gr.skip()] * len(self.specs) + [gr.skip()] * len(self.stage_groups) + [error_md(exc)]
        values, unknown = sf.raw_to_form(self.sections, raw)
        note += converted + (f"; keys the form does not know: {', '.join(unknown)}" if unknown else "")
        return [*values, *self.stage_visibility(str(raw.get("stage", "sft"))), note]

    def on_preview_page(self, page: float, delta: int, *values: Any) -> tuple[str, int]:
        try:
            raw = self.raw(values)
            model, data = raw.get("model") or {}, raw.get("data") or {}
            adapters = model.get("adapter_paths") or []
            adapters = adapters if isinstance(adapters, list) else [adapters]
            workspace.check_sources(model.get("name_or_path"), adapters, data.get("dataset_dir"))
            body, shown = preview.preview_page(raw, int(page or 0) + delta)
        except UserError as exc:
            return f'<pre class="rf-error">{exc}</pre>', int(page or 0)
        return body, shown

    def on_start(self, monitor: Any, *values: Any, request: gr.Request | None = None) -> list[Any]:
        """Launch; the Monitor tab opens on the new run, drawn in this same answer (``monitor.update``): a timer
        tick would first redraw the run it showed before (and one still drawing it answers nothing since)."""
        try:
            raw = self.raw(values)
            text = sf.raw_to_yaml(raw)
            config = runner.start(raw, text)
        except UserError as exc:
            return [*self.answer("", "", exc), gr.skip(), gr.skip(), *[gr.skip()] * len(monitor.outputs())]
        message = f"▶ started `rlfactory train {config.output_dir}/{runner.YAML_NAME}`"
        shown_run(request, config.output_dir)
        shown = monitor.update(config.output_dir, None)
        return [*self.answer(message, text), gr.Tabs(selected="monitor"), config.output_dir, *shown]

    def on_reattach(self) -> list[Any]:
        """On page load: a run going on (started from another tab, or before a reload) fills the form with its
        config, and its output dir goes to Monitor, whose Stop then stops it."""
        live = runner.live_runs()
        if not live:
            return [gr.skip()] * (len(self.specs) + len(self.stage_groups) + 2)
        run = str(live[0])
        if monitor_pipeline_stages(run):  # the form edits one run: Monitor follows the pipeline's stages
            note = f"● the pipeline in `{run}` is going on: the Monitor tab follows its stages, and Stop stops it"
            return [gr.skip()] * (len(self.specs) + len(self.stage_groups)) + [note, run]
        note = (
            f"● a run is going on in `{run}` (started from this page before a reload, or from another tab): "
            "the form shows its config, the Monitor tab follows it, and Stop stops it"
        )
        return [*self.form_from(str(Path(run) / runner.YAML_NAME), note), run]

    def on_stop(self, output_dir: str) -> str:
        return stop_message(output_dir or "outputs/run")

    def wire(self, tabs: Any, monitor: Any) -> None:
        inputs = self.inputs
        self.widgets["stage"].change(self.stage_visibility, self.widgets["stage"], list(self.stage_groups.values()))
        self.preview_btn.click(self.on_preview_yaml, inputs, [self.message, self.yaml_view])
        self.validate_btn.click(self.on_validate, inputs, self.check_outputs)
        self.plan.wire(inputs, self.raw, self.validate_btn)
        self.save_btn.click(self.on_save, [self.save_path, *inputs], [self.message, self.load_path])
        self.load_btn.click(self.on_load, self.load_path, [*inputs, *self.stage_groups.values(), self.message])
        for button, delta in ((self.show_btn, 0), (self.prev_btn, -1), (self.next_btn, 1)):
            button.click(
                lambda page, *v, d=delta: self.on_preview_page(page, d, *v),
                [self.page, *inputs],
                [self.preview_html, self.page],
            )

        def start(request: gr.Request, *values: Any) -> list[Any]:  # gradio passes a leading gr.Request parameter
            return self.on_start(monitor, *values, request=request)

        self.start_btn.click(start, inputs, [*self.check_outputs, tabs, monitor.run, *monitor.outputs()])
        self.stop_btn.click(self.on_stop, self.widgets["output_dir"], self.message)
        self.reward_panel.wire(self)
        self.model_picker.wire(self.widgets["model.name_or_path"], self.widgets["model.template"])
