"""The reward editor's widgets, inside the Train tab's reward section (shown for ppo and grpo)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import gradio as gr

from rlfactory.errors import UserError
from rlfactory.webui import reward_editor as editor
from rlfactory.webui import schema_form as sf


class RewardPanel:
    """Built under the reward section's fields; ``wire`` connects it to the form's ``reward.functions``. Errors are
    shown with the Train tab's ``error_md`` (handed in: this module is imported by train_tab)."""

    def __init__(self, error_md: Callable[[Exception], str]) -> None:
        self.error_md = error_md
        gr.Markdown("**Reward editor**: add rewards to `reward.functions` above, then test them on a few samples.")
        with gr.Row():
            self.builtin = gr.Dropdown(
                editor.builtin_rewards(), label="built-in reward", scale=4, elem_id="reward-builtin"
            )
            self.builtin_weight = gr.Number(1.0, label="weight", scale=1, elem_id="reward-builtin-weight")
            self.add_builtin_btn = gr.Button("Add", scale=1, elem_id="reward-add-builtin")
        with gr.Row():
            self.file = gr.Textbox(
                label="Python file", placeholder="path/to/rewards.py", scale=3, elem_id="reward-file"
            )
            self.function = gr.Textbox(
                label="function",
                placeholder="fn(prompt, completion, answer, example)",
                scale=2,
                elem_id="reward-function",
            )
            self.file_weight = gr.Number(1.0, label="weight", scale=1, elem_id="reward-file-weight")
            self.add_file_btn = gr.Button("Add from file", scale=1, elem_id="reward-add-file")
        self.error = gr.Markdown(visible=False, elem_id="reward-error")
        self.yaml = gr.Code(
            editor.reward_yaml({}),
            language="yaml",
            label="the run YAML's reward: section",
            interactive=False,
            elem_id="reward-yaml",
        )
        with gr.Row():
            self.prompts = gr.Number(
                2, precision=0, label="prompts (the first of data.dataset)", elem_id="reward-prompts"
            )
            self.samples = gr.Number(2, precision=0, label="samples per prompt", elem_id="reward-samples")
            self.test_btn = gr.Button("Test rewards", variant="secondary", elem_id="reward-test")
        self.test_message = gr.Markdown(elem_id="reward-test-message")
        self.table = gr.Dataframe(visible=False, wrap=True, elem_id="reward-test-table")

    def _added(self, action: Any, *args: Any) -> list[Any]:
        """The field's new text and a hidden error slot, or the field unchanged and the error shown here."""
        try:
            return [action(*args), gr.Markdown(visible=False)]
        except UserError as exc:
            return [gr.skip(), gr.Markdown(self.error_md(exc), visible=True)]

    def on_test(self, train: Any, prompts: Any, samples: Any, *values: Any) -> Iterator[list[Any]]:
        hidden = gr.Dataframe(visible=False)
        try:
            raw = train.raw(values)
            yield [f"● sampling {int(prompts or 0)} x {int(samples or 0)} completion(s) from the base model…", hidden]
            headers, rows, summary = editor.try_rewards(raw, int(prompts or 0), int(samples or 0))
        except UserError as exc:
            yield [self.error_md(exc), hidden]
            return
        yield ["✓ " + summary, gr.Dataframe(value=rows, headers=headers, visible=True, wrap=True)]

    def wire(self, train: Any) -> None:
        field = train.widgets[editor.FIELD]
        self.add_builtin_btn.click(
            lambda text, name, weight: self._added(editor.add_builtin, text, name, weight),
            [field, self.builtin, self.builtin_weight],
            [field, self.error],
        )
        self.add_file_btn.click(
            lambda text, file, fn, weight: self._added(editor.add_from_file, text, file, fn, weight),
            [field, self.file, self.function, self.file_weight],
            [field, self.error],
        )
        section = next(s for s in train.sections if s.name == "reward")
        alone = sf.SectionSpec(section.name, section.description, section.fields)  # no stage filter: raw of these
        widgets = [train.widgets[spec.path] for spec in section.fields]
        show = lambda *values: _yaml_of(alone, values, self.error_md)
        for widget in widgets:
            widget.change(show, widgets, [self.yaml, self.error], show_progress="hidden")

        def test(prompts: Any, samples: Any, *values: Any) -> Iterator[list[Any]]:
            yield from self.on_test(train, prompts, samples, *values)

        self.test_btn.click(
            test,
            [self.prompts, self.samples, *train.inputs],
            [self.test_message, self.table],
        )


def _yaml_of(section: sf.SectionSpec, values: tuple[Any, ...], error_md: Callable[[Exception], str]) -> list[Any]:
    try:
        return [editor.reward_yaml(sf.form_to_raw([section], list(values))), gr.Markdown(visible=False)]
    except UserError as exc:
        return [gr.skip(), gr.Markdown(error_md(exc), visible=True)]
