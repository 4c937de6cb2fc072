"""A small SentencePiece model trained with the Needle tokenizer settings, for tests.

The released Needle 2 tokenizer (8192 BPE pieces) lives on the Hugging Face Hub, which tests
cannot reach. Every tokenizer test therefore trains a stand-in in well under a second with the
same trainer settings: BPE; pad 0, eos 1, bos 2, unk 3; the ten chat markers as user-defined
symbols (ids 4-13); byte fallback; identity normalisation; extra whitespace kept; dummy prefix.
The corpus is built in code (no files, no network) and mixes the kinds of text the converted
tokenizer must reproduce: plain ASCII, accented Latin, CJK, emoji, code with indentation and
tabs, digits, runs of spaces, and rendered tool-calling prompts with their JSON.
"""

import io
import json
import os

import sentencepiece

#: Vocabulary size of the fixture model. Tests that pair the fixture tokenizer with a model
#: config must use this value as the config's vocab_size.
FIXTURE_VOCAB_SIZE = 800

#: The chat markers in id order (ids 4-13), as the Needle tokenizer declares them.
FIXTURE_CHAT_MARKERS = (
    "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tools>", "</tools>",
    "<tool_call>", "</tool_call>", "<tool_result>", "</tool_result>",
)

_ENGLISH = (
    "The quick brown fox jumps over the lazy dog.",
    "Set an alarm for seven thirty tomorrow morning and remind me to call the dentist.",
    "What is the weather going to be like in San Francisco this weekend?",
    "Please send a message to Alice saying that the meeting has moved to Thursday.",
    "Turn off the lights in the living room and lower the thermostat by two degrees.",
    "Play some relaxing jazz music in the kitchen at a moderate volume.",
    "Create a calendar event called project review on the first of March at noon.",
    "How many steps did I walk yesterday, and what was my average heart rate?",
    "Order a large pepperoni pizza and have it delivered to my office downtown.",
    "Translate the following sentence into French before the presentation starts.",
    "The invoice number, customer name and total amount are listed at the top of the page.",
    "A small model can call tools on a phone without sending anything to a server.",
)

_ACCENTED = (
    "Le café est très chaud, mais la crème brûlée est déjà prête.",
    "Müller fährt über die Brücke nach Köln, während es draußen schneit.",
    "El niño comió piña y jalapeños en la mañana del sábado.",
    "Ação, coração e informação são palavras portuguesas comuns.",
    "Tiếng Việt có nhiều dấu thanh: à, á, ả, ã, ạ.",
    "Zażółć gęślą jaźń — to zdanie ma wszystkie polskie litery.",
)

_CJK = (
    "今天天气很好，我们去公园散步吧。",
    "请把客厅的灯关掉，然后播放一些音乐。",
    "明日の午前九時に会議の予定を入れてください。",
    "東京駅から新宿駅までどのくらいかかりますか？",
    "오늘 저녁 일곱 시에 알람을 맞춰 주세요.",
    "서울의 날씨는 어떻습니까?",
)

_EMOJI = (
    "Great job today! 🎉🎉 Let's celebrate with pizza 🍕 and cake 🎂.",
    "Weather: ☀️ morning, 🌧️ afternoon, ❄️ at night. Stay warm 🧣!",
    "Reply with 👍 or 👎, and use ❤️ for favourites.",
)

_CODE = (
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "int main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    "const total = items.map((item) => item.price * item.count).reduce((a, b) => a + b, 0);",
    "SELECT name, email FROM users WHERE created_at > '2024-01-01' ORDER BY name;",
)

_WHITESPACE = (
    "columns    aligned    with    spaces",
    "  leading and trailing spaces  ",
    "tab\tseparated\tvalues\tin\ta\trow",
    "line one\nline two\n\nline four after a blank line",
    "mixed \t whitespace \n\t indentation",
)

_TOOLS = (
    {"name": "set_alarm", "description": "Set an alarm for a given time.",
     "parameters": {"type": "object", "properties": {
         "hour": {"type": "integer", "description": "Hour of the day, 0-23."},
         "minute": {"type": "integer", "description": "Minute, 0-59."}},
      "required": ["hour", "minute"]}},
    {"name": "send_message", "description": "Send a text message to a contact.",
     "parameters": {"type": "object", "properties": {
         "recipient": {"type": "string", "description": "Name of the contact."},
         "message": {"type": "string", "description": "Text to send."}},
      "required": ["recipient", "message"]}},
    {"name": "get_weather", "description": "Get the weather forecast for a city.",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string"}, "days": {"type": "integer"}},
      "required": ["city"]}},
    {"name": "play_music", "description": "Play music in a room.",
     "parameters": {"type": "object", "properties": {
         "genre": {"type": "string"}, "room": {"type": "string"},
         "volume": {"type": "number"}}}},
)

_CONTACTS = ("Alice", "Bob", "Chloé", "Dmitri", "Émile", "Fatima", "Grace", "Hiroshi", "李明", "김민준")
_CITIES = ("Paris", "Tokyo", "New York", "São Paulo", "Zürich", "北京", "Seoul", "Berlin", "Lagos", "Lima")


def _compact_json(value):
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _tool_call_examples():
    """Rendered tool-calling prompts and answers, the way the Needle fine-tuning data looks."""
    tools_json = _compact_json(list(_TOOLS))
    examples = []
    for index in range(40):
        contact = _CONTACTS[index % len(_CONTACTS)]
        city = _CITIES[(3 * index) % len(_CITIES)]
        hour, minute = (5 + index) % 24, (7 * index) % 60
        query = (f"Wake me at {hour}:{minute:02d}, text {contact} that I'm running late, "
                 f"and tell me the weather in {city} for {index % 7 + 1} days.")
        answers = [
            {"name": "set_alarm", "arguments": {"hour": hour, "minute": minute}},
            {"name": "send_message", "arguments": {"recipient": contact, "message": "I'm running late"}},
            {"name": "get_weather", "arguments": {"city": city, "days": index % 7 + 1}},
        ]
        reasoning = f"{hour}:{minute:02d} gives the alarm; {contact} is the recipient; {city} is the city."
        examples.append(
            "<|im_start|>user\n<tools>" + tools_json + "</tools>\n" + query + "<|im_end|>\n"
            + "<|im_start|>assistant\n<think>\n" + reasoning + "\n</think>\n"
            + "<tool_call>" + _compact_json(answers) + "</tool_call><|im_end|>"
        )
        examples.append("<tool_result>" + _compact_json({"temperature": 20 + index % 9, "city": city})
                        + "</tool_result>")
    return examples


def _digit_lines():
    return [f"Order {1000 + 17 * i} costs ${i * 3.25:.2f} on 2024-{i % 12 + 1:02d}-{i % 28 + 1:02d} "
            f"at {i % 24:02d}:{(11 * i) % 60:02d}, ref #{(i * 7919) % 100000:05d}."
            for i in range(60)]


def fixture_corpus():
    """Return the training sentences: every text family, repeated so BPE sees enough pairs."""
    families = (_ENGLISH, _ACCENTED, _CJK, _EMOJI, _CODE, _WHITESPACE)
    sentences = [sentence for family in families for sentence in family] * 4
    sentences += _tool_call_examples()
    sentences += _digit_lines()
    return sentences


def train_needle_spm(out_dir, vocab_size=FIXTURE_VOCAB_SIZE, **trainer_overrides):
    """Train a Needle-style SentencePiece BPE model into `out_dir` and return the model's path.

    Args:
        out_dir: folder to write `tokenizer.model` into (created if missing).
        vocab_size: number of pieces, reserved ones included (4 specials, 10 markers,
            256 byte pieces). The built-in corpus supports roughly 600-1200.
        trainer_overrides: SentencePiece trainer options that replace the Needle settings
            (tests use them to build models the converter must refuse).

    Returns:
        The path of the written `tokenizer.model` (a str).
    """
    os.makedirs(out_dir, exist_ok=True)
    model_bytes = io.BytesIO()
    settings = dict(
        model_type="bpe",
        vocab_size=vocab_size,
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        user_defined_symbols=list(FIXTURE_CHAT_MARKERS),
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        num_threads=1,
        minloglevel=2,
    )
    settings.update(trainer_overrides)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(fixture_corpus()), model_writer=model_bytes, **settings)
    model_path = os.path.join(out_dir, "tokenizer.model")
    with open(model_path, "wb") as handle:
        handle.write(model_bytes.getvalue())
    return model_path
