#!/usr/bin/env python3
"""Reference numbers for kvlens's caption metrics, computed by pycocoevalcap itself.

For every fixture set in tests/fixtures/coco/<set>/ (annotations.json + results.json) this
loads the files with pycocotools, tokenizes with pycocoevalcap's PTBTokenizer (Stanford
CoreNLP 3.4.1 in Java) and scores with its Bleu, Meteor, Rouge and Cider classes, the way
COCOEvalCap.evaluate does with params['image_id'] = the results' images (SPICE left out), and
writes <set>/expected.json. It also writes tests/fixtures/coco/ptb_cases.json: strings (a
curated list plus seeded random ones) with the raw output of the Java tokenizer on them and
pycocoevalcap's tokenized captions. kvlens never produces these numbers; test_coco_metrics
compares its own against them.

Needs Java and `pip install pycocoevalcap` (1.2). Run from the repository root:
    python3 tests/coco_reference.py
"""
import json
import os
import random
import subprocess
import sys
import tempfile

from pycocotools.coco import COCO
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.meteor.meteor import Meteor
from pycocoevalcap.rouge.rouge import Rouge
from pycocoevalcap.tokenizer import ptbtokenizer
from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "coco")
SETS = ["punctuation", "scenes", "natural"]


def score_set(name, meteor):
    d = os.path.join(ROOT, name)
    coco = COCO(os.path.join(d, "annotations.json"))
    res = coco.loadRes(os.path.join(d, "results.json"))
    img_ids = res.getImgIds()  # what COCOEvalCap uses once params['image_id'] is set to them
    gts = {i: coco.imgToAnns[i] for i in img_ids}
    rs = {i: res.imgToAnns[i] for i in img_ids}
    tok = PTBTokenizer()
    gts, rs = tok.tokenize(gts), tok.tokenize(rs)
    out = {"set": name, "images": len(img_ids)}
    bleu, _ = Bleu(4).compute_score(gts, rs, verbose=0)
    for k in range(4):
        out["BLEU-%d" % (k + 1)] = bleu[k]
    out["METEOR"], _ = meteor.compute_score(gts, rs)
    rouge, rouge_img = Rouge().compute_score(gts, rs)
    cider, cider_img = Cider().compute_score(gts, rs)
    out["ROUGE-L"], out["CIDEr-D"] = float(rouge), float(cider)
    out["per_image"] = {"image_id": list(img_ids), "ROUGE-L": [float(x) for x in rouge_img],
                        "CIDEr-D": [float(x) for x in cider_img]}
    out["tokenized"] = {"references": [gts[i] for i in img_ids], "candidates": [rs[i][0] for i in img_ids]}
    return out


CURATED = [
    "A man's dog, it's \"great\" (really) [yes] {no}.", "It's a black-and-white photo of the U.S. flag...",
    "Don't can't won't cannot gonna wanna gotta lemme gimme 'twas 'tis", "I'm sure they're fine & you'll see.",
    "Mr. Smith's 3.5 cats cost $1,000 at 10:30am -- 5% off!", "'Quoted' text and ``latex'' quotes, and/or stuff",
    "MIXED Case WORDS With Dots. The End", "e.g. the dog", "i.e., yes", "etc. The", "U.S. The", "U.S. the",
    "I. M. Pei", "No. 5 and no. the", "3 p.m. Then", "Jan. 5", "Inc. is", "Calif. The x", "miss. The x",
    "http://coco.org/x.jpg is", "www.flickr.com and foo.org", "mail me@x.com", "#hashtag @user", "<b>bold</b>",
    "<a href=\"x\">", "5 1/2 inches", "\u00bc cup", "$5.00", "\u00a320 and \u20ac30", "#1", "100%", "A&P and AT&T",
    "q&a", "C++ and c#", "10/20/2014", "9-11", "+5 -3", "-3.5", "1,000,000", ".5 and 0.5", "1990s '90s",
    "'til 'cause 'em rock 'n' roll y'all o'clock O'Neil d'Artagnan ma'am goin' dogs' James'",
    "shouldn't've I'd've we'll you're he'd she's I'M they've", "don\u2019t it\u2019s \u2018quoted\u2019 \u201cdouble\u201d",
    "\"start end\" \"\" \"a\" \" a \" 'a' ' a ' ''word''", "wow!!! what?! really?? hmm... hmm.... wait. . . yes",
    "a\u2026b x;y:z a,b a.b a.b. end. A. I. x.", "foo!bar yahoo! E! =) :-) ;) :D :P <3 a < b > c",
    "x=y == a*b ** *** @@ __init__ a_b ~tilde ^caret |pipe| \\back", "((nested)) 2+2 \u00b0F 30\u00b0C \u00a92014 \u00d7 \u2022 \u2122",
    "a high-quality well-known photo", "anti-war e-mail co-op uh-huh mid-1990s 5-year-old", "x--y x---y a - b ----",
    "caf\u00e9 na\u00efve Zo\u00eb \u00c9COLE stra\u00dfe \u0130stanbul \u041c\u043e\u0441\u043a\u0432\u0430 \u65e5\u672c\u8a9e",
    "a\u00a0b\u2009c\u200bd\ufeffe\u3000f", "soft\u00adhyphen \u2010 \u2011 \u2014dash\u2014 \u2013", "\u00abguill\u00bb \u201elow\u201f \u2039x\u203a \u201ax\u201b",
    "a\rb", "c\r\nd", "e\u2028f", "g\u000bh", "i\u000cj", "k\u0085l", "", "   ", "tab\there", "emoji \U0001F600 x",
    "3.pdf and file.jpg and 3.cgi", "U.S.-based 1.5-inch x-ray., y dog., cat", "Ph.D. The x", "a.k.a. The x",
]

WORDS = ("a an the man woman dog cat is are on in of with at red blue large small two three next to it's don't "
         "can't I'm they're we'll you've he'd won't isn't cannot gonna o'clock O'Neil y'all ma'am goin' dogs' U.S. "
         "e.g. i.e. etc. Mr. Dr. St. Jan. Inc. vs. No. fig. a.m. p.m. Ph.D. black-and-white x-ray e-mail 3-year-old "
         "1990s '90s 3.5 1,000 10:30 12/25/2014 1/2 5-6 $5 50% #1 @user #tag http://coco.org/x.jpg www.flickr.com "
         "me@x.com and/or A&P Q&A C++ c# :) :-( =) ^_^ <b> </i> 'til 'cause 'em 'n' Cap'n c'est 'hi 'a' ''q'' "
         "``l'' hello@ foo!bar wow!!! hmm... . .. ... .... , ; : - -- --- ( ) [ ] { } \" ' ` / * ** & &amp; &lt; "
         "&quot; &apos; &nbsp; &mdash; + = ~ ^ | \\ _ # @ < > << % US$ \u00a3 \u20ac \u00a5 \u00a2 \u00bc \u00bd "
         "\u2154 \u00b2 \u2082 \u00b0 \u00d7 \u2022 \u2122 \u00a9 \u2026 \u2014 \u2013 \u2018 \u2019 \u201c \u201d "
         "\u00ab \u00bb caf\u00e9 na\u00efve \u00c9COLE stra\u00dfe \u041c\u043e\u0441\u043a\u0432\u0430 "
         "\u65e5\u672c\u8a9e \ufb01").split(" ")
STARTERS = "A The It I He She We They This That Some However After About Since There These When While What Yet If In Now So Then Who How".split()
CHARS = [chr(c) for c in range(32, 127)] + list(
    "\u00a0\u00ad\u00e9\u00c9\u00fc\u00df\u00f1\u2018\u2019\u201c\u201d\u2013\u2014\u2026\u00ab\u00bb\u2039\u203a"
    "\u201a\u201b\u201e\u201f\u00b4\u00b0\u00bd\u00bc\u2153\u00a3\u20ac\u00a5\u00a2\u00d7\u2022\u2122\u00a9\u00ae"
    "\u0391\u03b1\u0416\u0436\u65e5\u3042\u30a2\uac00\u0301\u2009\u200b\u3000\u2010\u2011\u00b2\u2082\u00b5\u0130")


def fuzz_words(rng, n):
    out = []
    for _ in range(n):
        s = ""
        for _ in range(rng.randint(0, 12)):
            r = rng.random()
            w = rng.choice(WORDS) if r < 0.6 else rng.choice(STARTERS) if r < 0.75 else "".join(
                rng.choice(CHARS[:95]) for _ in range(rng.randint(1, 4)))
            if rng.random() < 0.15:
                w = w.upper()
            s += w + (" " if rng.random() < 0.8 else rng.choice(["", "", "  ", "\t", "\u00a0"]))
        out.append(s)
    return out


def fuzz_chars(rng, n):
    return ["".join(rng.choice(CHARS) if rng.random() < 0.6 else rng.choice("aeiouyntsdlmrAEIOUNTSDLMR .'-,")
                    for _ in range(rng.randint(1, 30))) for _ in range(n)]


def java_tokenize(text):
    jar = os.path.join(os.path.dirname(os.path.abspath(ptbtokenizer.__file__)), ptbtokenizer.STANFORD_CORENLP_3_4_1_JAR)
    with tempfile.NamedTemporaryFile(delete=False) as f:
        f.write(text.encode())
    try:
        cmd = ["java", "-cp", jar, "edu.stanford.nlp.process.PTBTokenizer", "-preserveLines", "-lowerCase", f.name]
        return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, check=True).stdout.decode()
    finally:
        os.remove(f.name)


def ptb_cases():
    rng = random.Random(20240611)
    strings = CURATED + fuzz_words(rng, 1200) + fuzz_chars(rng, 1200)
    groups = []
    for k in range(0, len(strings), 400):  # several texts, so that each starts on a fresh line
        caps = strings[k:k + 400]
        text = "\n".join(c.replace("\n", " ") for c in caps)
        coco = PTBTokenizer().tokenize({i: [{"caption": c}] for i, c in enumerate(caps)})
        groups.append({"captions": caps, "ptb_output": java_tokenize(text),
                       "coco_tokenized": [coco[i][0] if i in coco else None for i in range(len(caps))]})
    return {"source": "Stanford CoreNLP 3.4.1 PTBTokenizer -preserveLines -lowerCase (pycocoevalcap 1.2)",
            "groups": groups}


def main():
    meteor = Meteor()
    for name in SETS:
        out = score_set(name, meteor)
        with open(os.path.join(ROOT, name, "expected.json"), "w") as f:
            json.dump(out, f, indent=1, ensure_ascii=False)
            f.write("\n")
        print(name, {k: round(v, 6) for k, v in out.items() if isinstance(v, float)})
    with open(os.path.join(ROOT, "ptb_cases.json"), "w") as f:
        json.dump(ptb_cases(), f, ensure_ascii=False)
        f.write("\n")
    print("ptb_cases.json written")


if __name__ == "__main__":
    sys.exit(main())
